"""verl-shaped vision-language batches and a teacher-forced log-prob pass, for the multimodal recipe tests.

A tiny Qwen2-VL (``hdreplay_lab.sandbox.vlm``, saved and reloaded with ``from_pretrained``) and the geo task's
PIL images.  Rows are built the way verl 0.9.1's agent loop builds them (``agent_loop.py``:
``_compute_multi_modal_inputs``, ``_compute_position_ids``, ``_postprocess``):

* ``multi_modal_inputs[i]``: the processor's outputs for the row's prompt minus input_ids / attention_mask /
  mm_token_type_ids, plus ``images_seqlens``; the n rows of a prompt hold copies;
* ``position_ids (B, 4, P+R)``: row 0 = ``arange`` over the valid tokens with 1 at pads, rows 1-3 = the model's
  ``get_rope_index`` (mm_token_type_ids rebuilt from the image token id, as verl does);
* responses: random text tokens (no vision tokens).

:func:`vlm_logprobs` scores rows the way verl's engine does before its model call: ``DataProto.to_tensordict``,
``left_right_2_no_padding`` (nested ids, per-row ``(4, L_i)`` positions), ``extract_multi_modal_inputs`` on the
rows' dicts, then ``no_padding_2_padding`` back to ``(B, R)``.  The model call itself is the plain transformers
forward with ``(4, 1, L)`` position ids (verl's patched forward needs flash-attention varlen kernels, not on CPU);
``images_seqlens`` is only read by verl's patch and is left out.
"""

from __future__ import annotations

import uuid

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.utils import tensordict_utils as tu
from verl.utils.model import extract_multi_modal_inputs
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from hdreplay_lab.sandbox.geo import GeoTask

TASK = GeoTask()


def chat_prompts(proc, problems) -> list[str]:
    msgs = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": p.question}]}] for p in problems]
    return proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def prompt_inputs(proc, problem) -> tuple[torch.Tensor, dict]:
    """(prompt ids (P,), multi_modal_inputs dict) of one prompt, as verl's agent loop keeps them."""
    enc = dict(proc(text=chat_prompts(proc, [problem]), images=[[problem.image()]], return_tensors="pt"))
    ids = enc.pop("input_ids")[0]
    enc.pop("attention_mask")
    enc.pop("mm_token_type_ids", None)
    grid = enc["image_grid_thw"]
    enc["images_seqlens"] = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    return ids, enc


def verl_positions(model, input_ids: torch.Tensor, attention: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """(4, L) position ids of one padded row, as ``AgentLoopWorker._compute_position_ids``."""
    mm_types = (input_ids == model.config.image_token_id).long()[None]
    rope, _ = model.model.get_rope_index(input_ids=input_ids[None], mm_token_type_ids=mm_types, image_grid_thw=grid,
                                         attention_mask=attention[None])
    text = torch.ones(1, input_ids.numel(), dtype=torch.long)
    valid = attention.bool()
    text[0, valid] = torch.arange(int(valid.sum()))
    return torch.cat([text, rope[:, 0]], dim=0)


def vlm_rows(model, proc, problems, n: int, *, seed: int, R: int = 6, vocab_hi: int = 40,
             rewards=None) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Tensor rows and per-row multi_modal_inputs of ``problems`` x n responses (each prompt's rows consecutive).

    rewards(p_index, j) -> reward of response j (default: 1 on even j, so every group is mixed)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [prompt_inputs(proc, p) for p in problems]
    P = max(ids.numel() for ids, _ in prompts)
    pad = proc.tokenizer.pad_token_id
    rows, mm = [], []
    for pi, (ids, inputs) in enumerate(prompts):
        for j in range(n):
            L = int(torch.randint(2, R + 1, (1,), generator=g))
            resp = torch.randint(3, vocab_hi, (L,), generator=g)  # characters only: no vision tokens
            prompt = torch.cat([torch.full((P - ids.numel(),), pad), ids])
            response = torch.cat([resp, torch.full((R - L,), pad)])
            attn = torch.cat([torch.arange(P) >= P - ids.numel(), torch.arange(R) < L]).long()
            seq = torch.cat([prompt, response])
            score = torch.zeros(R)
            score[L - 1] = float(j % 2 == 0) if rewards is None else rewards(pi, j)
            rows.append({"prompts": prompt, "responses": response, "input_ids": seq, "attention_mask": attn,
                         "position_ids": verl_positions(model, seq, attn, inputs["image_grid_thw"]),
                         "response_mask": (torch.arange(R) < L).long(), "rm_scores": score})
            mm.append({k: v.clone() for k, v in inputs.items()})
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}, mm


@torch.no_grad()
def vlm_logprobs(model, batch: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """(B, R) teacher-forced log-probs of the responses through verl's engine-side input preparation."""
    td = left_right_2_no_padding(batch.to_tensordict())
    rows = list(tu.get(td, "multi_modal_inputs"))
    out = []
    for i, (ids, pos) in enumerate(zip(td["input_ids"].unbind(0), td["position_ids"].unbind(0))):
        inputs = extract_multi_modal_inputs([rows[i]])
        inputs.pop("images_seqlens", None)
        logits = model(input_ids=ids[None], position_ids=pos[:, None, :], **inputs).logits[0].float() / temperature
        lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.roll(ids, -1)[:, None]).squeeze(-1)
        out.append(torch.cat([lp[:-1], lp.new_zeros(1)]))
    nested = torch.nested.as_nested_tensor(out, layout=torch.jagged)
    return no_padding_2_padding(nested, td)


def vlm_batch(model, proc, problems, n: int, *, seed: int, config, rewards=None) -> DataProto:
    """A batch as ``_update_actor`` receives it: rollout rows, real old log-probs, rewards, uid, GRPO advantages."""
    t, mm = vlm_rows(model, proc, problems, n, seed=seed, rewards=rewards)
    B = t["prompts"].shape[0]
    uid = np.repeat(np.array([str(uuid.UUID(int=1000 + i)) for i in range(len(problems))], dtype=object), n)
    non = {"uid": uid, "multi_modal_inputs": np.array(mm, dtype=object),
           "data_source": np.array(["geo"] * B, dtype=object)}
    t["token_level_scores"] = t["rm_scores"].clone()
    t["token_level_rewards"] = t["rm_scores"].clone()
    batch = DataProto.from_dict(tensors=t, non_tensors=non, meta_info={"temperature": 1.0})
    batch.batch["old_log_probs"] = vlm_logprobs(model, batch)
    algo = config.algorithm
    return compute_advantage(batch, adv_estimator=algo.adv_estimator, num_repeat=n, config=algo)


def v1_trajectory(model, proc, *, R: int = 6, vocab_hi: int = 40):
    """A stub-agent-loop row function for verl's v1 fit (``verl_v1_harness.StubAgentLoopManagerTQ``): response j
    of prompt p at ``step`` as ``AgentLoopWorkerTQ._agent_loop_postprocess`` writes it for a vision-language model
    -- unpadded ids, ``(4, P+L)`` positions from ``get_rope_index``, the prompt's ``multi_modal_inputs`` (the geo
    problem p's image); random text responses, reward 1 on even j unless ``flat(p)``."""
    problems = TASK.train_problems(64, seed=11)
    cache: dict[int, tuple] = {}

    def trajectory(p: int, j: int, *, step: int, flat) -> dict:
        if p not in cache:
            cache[p] = prompt_inputs(proc, problems[p % len(problems)])
        ids, inputs = cache[p]
        g = torch.Generator().manual_seed(100_003 * step + 101 * p + j)
        L = int(torch.randint(2, R + 1, (1,), generator=g))
        resp = torch.randint(3, vocab_hi, (L,), generator=g)
        seq = torch.cat([ids, resp])
        scores = torch.zeros(L)
        scores[-1] = 1.0 if flat(p) else float(j % 2 == 0)
        mask = torch.ones(L, dtype=torch.int64)
        return {"prompts": ids, "responses": resp, "response_mask": mask, "loss_mask": mask, "input_ids": seq,
                "attention_mask": torch.ones_like(seq), "rm_scores": scores, "num_turns": 2,
                "position_ids": verl_positions(model, seq, torch.ones_like(seq), inputs["image_grid_thw"]),
                "rollout_log_probs": -torch.rand(L, generator=g),
                "multi_modal_inputs": {k: v.clone() for k, v in inputs.items()}}

    return trajectory
