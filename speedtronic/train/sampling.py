"""``speedtronic sample``: continue a prompt with a trained model, seeded and reproducible.

:func:`generate` is plain autoregressive decoding without a KV cache (the context is the last
``block_size`` tokens, recomputed each step): temperature 0 is greedy, otherwise logits are
divided by the temperature, cut to the ``top_k`` most likely tokens when given, and sampled
from a private ``torch.Generator`` seeded with ``seed`` (the global RNG is untouched), so the
same weights, prompt, settings and device give the same text. Decoding stops after
``max_new_tokens`` or at the tokenizer's end-of-text token.

:func:`sample` loads the weights ``speedtronic eval`` would (a checkpoint, a ``final/``
folder, a ``.safetensors`` state or the DiLoCo global), encodes the prompt with the
``data.tokenizer`` of the config, and returns a :class:`Sample` whose ``text`` is prompt +
continuation decoded as one text. A prompt starts a new document: it is preceded by the
end-of-text token when the tokenizer has one (:func:`prompt_ids`), and the exported model's
tokenizer puts the same token first, so greedy decoding here and transformers' ``generate`` on
the export give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from speedtronic.config import SpeedtronicConfig
from speedtronic.train.scoring import Weights

if TYPE_CHECKING:
    from speedtronic.data.tokenizer import Tokenizer

__all__ = ["Sample", "generate", "prompt_ids", "sample"]


def _next_logits(model: torch.nn.Module, context: torch.Tensor) -> torch.Tensor:
    out = model(context)
    logits: torch.Tensor = out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)
    return logits[:, -1, :].float()  # (1, V)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: list[int],
    *,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    eos_id: int | None = None,
) -> list[int]:
    """The ids that follow ``prompt`` (at most ``max_new_tokens``; see the module docstring)."""
    if not prompt:
        raise ValueError("generate needs at least one prompt token")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(int(seed))
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    new: list[int] = []
    for _ in range(int(max_new_tokens)):
        logits = _next_logits(model, ids[:, -block_size:])
        if temperature == 0:
            choice = logits.argmax(dim=-1, keepdim=True)  # (1, 1)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(int(top_k), logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            choice = torch.multinomial(probs, 1, generator=generator)  # (1, 1)
        token = int(choice)
        if eos_id is not None and token == eos_id:
            break
        new.append(token)
        ids = torch.cat((ids, choice.to(ids.dtype)), dim=1)
    return new


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The ids a prompt is continued from: the end-of-text token first when the tokenizer has
    one (in training every document but the first follows it, so a prompt starts a new
    document), then the prompt's tokens. The exported tokenizer adds the same token
    (``speedtronic.model.export``), so transformers' ``generate`` on ``tokenizer(prompt)``
    starts from these ids."""
    ids = [int(i) for i in tokenizer.encode(prompt)]
    return [int(tokenizer.eos_id), *ids] if tokenizer.eos_id is not None else ids


@dataclass
class Sample:
    """A continuation: ``prompt_ids`` (with the leading end-of-text token, if any), the
    ``new_ids`` generated, ``text`` (prompt + continuation, decoded together) and the
    ``weights`` it came from (source, step)."""

    text: str
    prompt_ids: list[int]
    new_ids: list[int]
    weights: Weights


def sample(
    config: SpeedtronicConfig,
    *,
    prompt: str,
    checkpoint: str | None = None,
    use_global: bool = False,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> Sample:
    """Prompt + sampled continuation, decoded with the config's tokenizer (see the module
    docstring).

    Raises ``ConfigError`` for an empty prompt with a tokenizer that has no end-of-text token
    to start from, ``CheckpointError`` for weights that cannot be found or do not fit.
    """
    from speedtronic.config import ConfigError
    from speedtronic.data.tokenizer import tokenizer_for
    from speedtronic.train.runtime import _device
    from speedtronic.train.scoring import load_model

    tokenizer = tokenizer_for(config)
    ids = prompt_ids(tokenizer, prompt)
    if not ids:
        raise ConfigError(
            "sample: the prompt is empty and the byte tokenizer has no end-of-text token to "
            "start from; pass --prompt TEXT"
        )
    model, weights = load_model(config, checkpoint=checkpoint, use_global=use_global)
    model.to(_device(config, None))
    new = generate(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        block_size=int(config.model.max_seq_len),
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        eos_id=tokenizer.eos_id,
    )
    shown = ids[1:] if tokenizer.eos_id is not None else ids
    text = tokenizer.decode(shown + new)  # decoded together: no character cut in two
    return Sample(text, ids, new, weights)
