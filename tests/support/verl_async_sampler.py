"""A sampler for the v1 harness's stub agent loop: a perturbed copy of the policy.

The stub agent loop (``verl_v1_harness.StubAgentLoopManagerTQ``) takes a ``trajectory(p, j, *, step, flat)``
function; :class:`PerturbedSampler` is one: the tiny policy the CPU workers train, loaded from the same directory
with gaussian noise added to its weights (an inference engine that differs from the trainer), sampling each
response with HF ``generate`` and reporting the log-prob it sampled each token with as ``rollout_log_probs``.
Prompts and rewards follow the stub's rules (prompt p: 3 + p % 5 tokens; reward 1 on even responses unless
``flat(p)``).
"""

from __future__ import annotations

import torch

from hdreplay_lab.sandbox.model import load_model
from verl_helpers import VOCAB


class PerturbedSampler:
    def __init__(self, model_dir: str, *, noise: float = 0.02, seed: int = 0, max_new_tokens: int = 6):
        self.model, _ = load_model(model_dir)
        self.model.eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for prm in self.model.parameters():
                prm.add_(noise * torch.randn(prm.shape, generator=g))
        self.max_new_tokens = max_new_tokens
        self.rows: dict[tuple[int, int, int], dict] = {}  # (p, j, step) -> the row it produced

    @torch.no_grad()
    def __call__(self, p: int, j: int, *, step: int, flat) -> dict:
        plen = 3 + p % 5
        prompt = 3 + (torch.arange(plen) * 7 + p) % (VOCAB - 3)
        torch.manual_seed(100_003 * step + 101 * p + j)
        out = self.model.generate(prompt[None], attention_mask=torch.ones(1, plen, dtype=torch.long), do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=self.max_new_tokens,
                                  min_new_tokens=2, output_logits=True, return_dict_in_generate=True,
                                  pad_token_id=0, eos_token_id=1)
        resp = out.sequences[0, plen:]
        lp = torch.log_softmax(torch.stack(out.logits, 1)[0].float(), -1).gather(-1, resp[:, None])[:, 0]
        if 1 in resp.tolist():  # cut after EOS
            end = resp.tolist().index(1) + 1
            resp, lp = resp[:end], lp[:end]
        rlen = resp.numel()
        reward = 1.0 if flat(p) else float(j % 2 == 0)
        scores = torch.zeros(rlen)
        scores[-1] = reward
        mask = torch.ones(rlen, dtype=torch.int64)
        ids = torch.cat([prompt, resp])
        row = {"prompts": prompt, "responses": resp, "response_mask": mask, "loss_mask": mask, "input_ids": ids,
               "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(ids.numel()), "rm_scores": scores,
               "rollout_log_probs": lp, "num_turns": 2}
        self.rows[(p, j, step)] = row
        return row
