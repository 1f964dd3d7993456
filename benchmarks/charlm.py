"""A character-level language model on a corpus every machine has: the Python
standard library's own ``.py`` source (``sysconfig.get_paths()["stdlib"]``).

**The corpus**: every ``.py`` file under the stdlib directory, ``site-packages``
and test directories left out, in sorted path order, as bytes (a 256-symbol
vocabulary, no tokenizer), concatenated and cut at ``CORPUS_BYTES``. The last
``VALID_FRACTION`` of it is the held-out validation split. Which files exist
depends on the Python version, so the corpus is fingerprinted (its size and a
SHA-256 prefix are in every result).

**The model**: a GPT-style decoder (``nn.TransformerEncoderLayer`` with a causal
mask, pre-norm), learned positions, untied output head: 2 layers, width 128, 4
heads, context 64: 0.47M parameters, 1.9 MB of fp32, a few tens of ms a step of
16 sequences on one core here.

    >>> x, y = batches(torch.arange(200, dtype=torch.uint8), [3, 70], context=8)
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([2, 8]), True)
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig

import torch
import torch.nn as nn
import torch.nn.functional as F

CORPUS_BYTES = 4 << 20  # 4 MiB: ~15 epochs' worth of no run here, so no sample repeats much
VALID_FRACTION = 0.05
CONTEXT = 64
VOCAB = 256


@functools.lru_cache(maxsize=1)
def corpus():
    """(train bytes, validation bytes, fingerprint) as uint8 tensors and a string."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "test", "tests"))
        paths += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    data, size = [], 0
    for path in sorted(paths, key=lambda p: os.path.relpath(p, root)):
        with open(path, "rb") as f:
            data.append(f.read())
        size += len(data[-1])
        if size >= CORPUS_BYTES:
            break
    text = b"".join(data)[:CORPUS_BYTES]
    cut = int(len(text) * (1 - VALID_FRACTION))
    all_bytes = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    fingerprint = f"{len(text)} bytes, sha256 {hashlib.sha256(text).hexdigest()[:12]}"
    return all_bytes[:cut].clone(), all_bytes[cut:].clone(), fingerprint


def batches(data: torch.Tensor, starts, context: int = CONTEXT):
    """(inputs, targets) of the windows starting at ``starts``: long tensors."""
    idx = torch.as_tensor(starts).view(-1, 1) + torch.arange(context + 1)
    window = data[idx].long()
    return window[:, :-1], window[:, 1:]


class CharLM(nn.Module):
    """Embedding, positions, pre-norm causal transformer layers, a final norm, the head."""

    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4, context=CONTEXT):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        nn.init.normal_(self.position, std=0.02)
        self.register_buffer(
            "mask", torch.triu(torch.full((context, context), float("-inf")), 1), persistent=False
        )

    def forward(self, x):
        t = x.shape[1]
        h = self.embed(x) + self.position[:t]
        for block in self.blocks:
            h = block(h, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def loss(model: nn.Module, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def validation_loss(model: nn.Module, valid: torch.Tensor, windows: int = 128) -> float:
    """Mean loss (nats per byte) over ``windows`` fixed, evenly spaced validation windows."""
    starts = torch.linspace(0, len(valid) - CONTEXT - 2, windows).long()
    x, y = batches(valid, starts)
    with torch.no_grad():
        return loss(model, x, y).item()
