"""A CPU stand-in for the vLLM engine, so TRL 1.16's own ``use_vllm=True`` path runs without vllm or a GPU.

Only the engine boundary is replaced -- four module globals of ``trl.generation.vllm_generation``, looked up
at call time:

    is_vllm_available -> True        (checked by VLLMGeneration._init_vllm)
    LLM, SamplingParams              colocate mode: ``LLM.generate`` and the weight-loading hook
    VLLMClient                       server mode: TRL's own VLLMClient with only HTTP (``_post``), the NCCL
                                     communicator and the weight broadcast replaced

Everything else is TRL's: VLLMGeneration.generate / sync_weights / extract_logprobs, VLLMClient.generate /
parse_logprobs, GRPOTrainer's importance-sampling correction and loss.

The engine is a separate copy of the model (like vLLM's), loaded from ``model.name_or_path`` and kept in sync
through TRL's own weight sync.  It samples with HF ``generate`` and returns each sampled token's *processed*
log-prob (vLLM's ``logprobs_mode="processed_logprobs"``) computed from logits rounded to bfloat16, i.e.
perturbed the way a bf16 engine's log-probs differ from an fp32 trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import trl.generation.vllm_generation as vg
from transformers import AutoModelForCausalLM
from trl.generation.vllm_client import VLLMClient as _RealVLLMClient

#: os.environ keys VLLMGeneration sets in colocate mode (tests restore them)
COLOCATE_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Engine:
    """The sampler: an HF copy of the model, log-probs from bf16-rounded processed logits."""

    def __init__(self, model_path):
        from hdreplay_lab.sandbox.model import quiet_hf_progress

        with quiet_hf_progress():
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.pad = self.model.generation_config.pad_token_id or 0
        self.loads = 0
        self.max_logprob_error = 0.0  # largest |bf16 - fp32| processed log-prob seen (the perturbation)

    def load_weights(self, weights):  # vLLM's model.load_weights(iterable of (name, tensor))
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t.detach().to(params[name].dtype))
        self.loads += 1

    @torch.no_grad()
    def sample(self, prompts, *, n, temperature, top_p, top_k, min_p, repetition_penalty, max_tokens,
               sequence_bias=None, **_):
        """n samples per prompt -> per prompt, n (token_ids incl. EOS, log-prob per token, rank per token)."""
        rows = [list(p) for p in prompts for _ in range(n)]
        L = max(len(p) for p in rows)
        ids = torch.tensor([[self.pad] * (L - len(p)) + p for p in rows])
        att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in rows])
        if isinstance(sequence_bias, list):
            sequence_bias = {tuple(k): v for k, v in sequence_bias}
        out = self.model.generate(
            input_ids=ids, attention_mask=att, do_sample=True, max_new_tokens=max_tokens,
            temperature=temperature, top_p=top_p if top_p < 1 else None, top_k=top_k if top_k and top_k > 0 else None,
            min_p=min_p or None, repetition_penalty=repetition_penalty if repetition_penalty != 1 else None,
            sequence_bias=sequence_bias, eos_token_id=self.eos, pad_token_id=self.pad, output_scores=True,
            return_dict_in_generate=True,
        )
        gen = out.sequences[:, L:]
        scores = torch.stack(list(out.scores), 1).float()  # processed logits (temperature, top-k/p, bias)
        exact = torch.log_softmax(scores, -1)
        lps = torch.log_softmax(scores.to(torch.bfloat16).float(), -1)  # a bf16 engine's rounding
        tok_lp = lps.gather(-1, gen.unsqueeze(-1)).squeeze(-1)
        err = (tok_lp - exact.gather(-1, gen.unsqueeze(-1)).squeeze(-1)).abs()
        ranks = (lps > tok_lp.unsqueeze(-1)).sum(-1) + 1
        res = []
        for b in range(gen.shape[0]):
            toks, lp, rk = gen[b].tolist(), tok_lp[b].tolist(), ranks[b].tolist()
            end = next((i + 1 for i, t in enumerate(toks) if t in self.eos), len(toks))  # keep EOS, like vLLM
            self.max_logprob_error = max(self.max_logprob_error, float(err[b, :end].max()))
            res.append((toks[:end], lp[:end], rk[:end]))
        return [res[i * n:(i + 1) * n] for i in range(len(prompts))]


class SamplingParams:  # vllm.SamplingParams(**kwargs)
    def __init__(self, **kw):
        self.__dict__.update(kw)


@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # the fields TRL reads
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    text: str = ""
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class _NS:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeLLM:
    """``vllm.LLM(model=model.name_or_path, ..., logprobs_mode="processed_logprobs")`` on CPU."""

    instances: list["FakeLLM"] = []

    def __init__(self, model, **kwargs):
        self.init_kwargs = kwargs
        self.engine = Engine(model)
        self.llm_engine = _NS(
            model_executor=_NS(driver_worker=_NS(model_runner=_NS(model=_NS(load_weights=self.engine.load_weights)))),
            model_config=_NS(max_model_len=kwargs.get("max_model_len")
                             or self.engine.model.config.max_position_embeddings),
        )
        self.generate_calls = 0
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        sp = dict(sampling_params.__dict__)
        self.generate_calls += 1
        token_lists = [p["prompt_token_ids"] for p in prompts]
        samples = self.engine.sample(token_lists, **sp)
        want = sp.get("logprobs") is not None
        outs = []
        for i, (p, per) in enumerate(zip(token_lists, samples)):
            comps = [CompletionOutput(index=j, token_ids=t,
                                      logprobs=([{tok: Logprob(lp_, r)} for tok, lp_, r in zip(t, lp, rk)]
                                                if want else None))
                     for j, (t, lp, rk) in enumerate(per)]
            outs.append(RequestOutput(request_id=str(i), prompt_token_ids=list(p), outputs=comps))
        return outs

    def reset_prefix_cache(self):
        return True

    def sleep(self, level=1):
        pass

    def wake_up(self, tags=None):
        pass


class FakeVLLMClient(_RealVLLMClient):
    """TRL's VLLMClient; only HTTP (``_post``), the NCCL communicator and weight streaming are replaced. The
    "server" samples with its own copy of ``model_path``."""

    model_path: str = ""
    instances: list["FakeVLLMClient"] = []

    def __init__(self, base_url=None, host="0.0.0.0", server_port=8000, group_port=51216, connection_timeout=0.0):
        self.base_url = base_url or f"http://{host}:{server_port}"
        self.group_port = group_port
        self.communicator = None
        self._updating_weights = False
        self.model = "stand-in"
        self.engine = Engine(self.model_path)
        self.posts: list[str] = []
        FakeVLLMClient.instances.append(self)

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}, "weight_transfer_config": {"backend": "nccl"}}

    def get_world_size(self):
        return 1

    def init_communicator(self, device=0):
        self.communicator = "stand-in"

    def update_named_params(self, metadata, named_params):
        self.engine.load_weights(list(named_params))

    def reset_prefix_cache(self):
        self.posts.append("/reset_prefix_cache")

    def close_communicator(self):
        self.communicator = None

    def _post(self, url, **kwargs):
        path = url[len(self.base_url):]
        self.posts.append(path)
        if path != "/v1/completions":
            return {}
        body = kwargs["json"]
        n = body.get("n", 1)
        samples = self.engine.sample(body["prompt"], n=n, temperature=body["temperature"], top_p=body["top_p"],
                                     top_k=body["top_k"], min_p=body["min_p"],
                                     repetition_penalty=body["repetition_penalty"], max_tokens=body["max_tokens"],
                                     sequence_bias=body.get("sequence_bias"))
        choices = []  # OpenAI completions format, prompt-major, return_tokens_as_token_ids=True
        for p, per in zip(body["prompt"], samples):
            for t, lp, _ in per:
                logprobs = None
                if body.get("logprobs") is not None:
                    logprobs = {"tokens": [f"token_id:{x}" for x in t], "token_logprobs": lp,
                                "top_logprobs": [{} for _ in t], "text_offset": [0] * len(t)}
                choices.append({"prompt_token_ids": list(p), "token_ids": list(t), "logprobs": logprobs, "text": ""})
        return {"choices": choices}


def install(monkeypatch, model_path: str) -> None:
    """Patch the engine boundary for one test (restored by ``monkeypatch``, the colocate env vars included)."""
    import os

    FakeLLM.instances.clear()
    FakeVLLMClient.instances.clear()
    for k in COLOCATE_ENV:  # VLLMGeneration sets these in colocate mode; monkeypatch restores them afterwards
        if k in os.environ:
            monkeypatch.setenv(k, os.environ[k])
        else:  # recorded as absent, so a value set later is removed again
            monkeypatch.setenv(k, "")
            monkeypatch.delenv(k)
    monkeypatch.setattr(FakeVLLMClient, "model_path", str(model_path))
    monkeypatch.setattr(vg, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vg, "LLM", FakeLLM, raising=False)
    monkeypatch.setattr(vg, "SamplingParams", SamplingParams, raising=False)
    monkeypatch.setattr(vg, "VLLMClient", FakeVLLMClient, raising=False)
