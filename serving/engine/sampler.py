"""One batched sampling pass over the sequences that sample this step.

Every row of ``logits`` belongs to one sequence with its own ``SamplingParams``. The
pass is vectorised over the batch: per-request parameters become one tensor per
parameter per call, and a stage that no row of the batch uses is skipped entirely.

Order of processing (each stage works on the result of the previous one):

1. logprobs: if any row asked for them, ``log_softmax`` of the RAW logits is taken
   first; after sampling it yields the chosen token's logprob, its rank
   (1 + the number of tokens with a strictly higher logprob) and the top-k
   alternatives. Logprobs therefore describe the model's distribution, never the
   processed one (vLLM's default).
2. ``logit_bias`` is added.
3. ``min_tokens``: while fewer output tokens exist, the EOS ids and the request's
   ``stop_token_ids`` are set to -inf (``ignore_eos`` does not matter here).
4. penalties: ``repetition_penalty`` over prompt + output tokens (positive logits
   divided, negative multiplied: HF/vLLM), then ``frequency_penalty`` × count and
   ``presence_penalty`` × [count > 0] over the output tokens (OpenAI).
5. structured output: the grammar's token bitmask sets disallowed tokens to -inf.
   A grammar that only allows EOS overrides ``min_tokens`` (the JSON is complete; the
   alternative would be a row with no token left).
6. greedy rows (temperature 0) take the argmax of the processed logits. The other
   rows are divided by their temperature, then filtered by min_p, top_k and top_p
   (top_k alone never sorts; top_p first looks at each row's best 256 tokens and
   sorts only the rows whose nucleus is wider), then sampled with the exponential
   race ``argmax(probs / E)``, ``E ~ Exponential(1)`` i.i.d. per token, which draws
   from ``probs`` without a CDF search. It is computed in log space as
   ``argmax(logits - log E)`` (the Gumbel-max form: no softmax pass), with
   ``E = -log U`` from uniforms (CPU ``exponential_`` is several times slower). A row
   whose sequence has a ``generator`` (seeded request) draws its own V uniforms from
   it every step, so its tokens depend only on its seed and its logits, never on its
   batch companions; the other rows share one batched draw.

``logits`` are consumed: the stages work in place on the tensor passed in (a
float32 tensor is not copied first).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from llmkube.serving.engine.outputs import TokenLogprob
from llmkube.serving.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmkube.serving.engine.structured import GrammarState

_NEG_INF = float("-inf")
# prompt_logprobs works through the prompt in chunks of at most this many logits, so
# a long prompt over a large vocabulary never materialises [T, V] twice at once.
_PROMPT_LOGPROBS_CHUNK_ELEMENTS = 1 << 24
# top_p first looks at this many best tokens per row (see _top_p).
_TOP_P_CANDIDATES = 256


class SamplingRow(Protocol):
    """What the sampler reads of a sequence (the engine's ``Sequence`` satisfies it).

    The sampler never mutates a row: appending the token and advancing the grammar
    (``grammar.accept``) is the engine's job.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    grammar: GrammarState | None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows whose params.logprobs is None


class Sampler:
    """Samples one token per row; see the module docstring for the order of stages."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows "
                f"over a vocabulary of {self.vocab_size}"
            )
        if not rows:
            return SamplerOutput([], [])
        logits = logits.float()
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            selected = logits if len(lp_rows) == len(rows) else logits[lp_rows]
            raw_logprobs = torch.log_softmax(selected, dim=-1)
        process_logits(logits, rows, self.eos_token_ids)
        token_ids = sample(logits, rows)
        token_list: list[int] = token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            ks = [rows[i].params.logprobs or 0 for i in lp_rows]
            chosen = token_ids if len(lp_rows) == len(rows) else token_ids[lp_rows]
            for i, entry in zip(lp_rows, gather_logprobs(raw_logprobs, chosen, ks), strict=True):
                logprobs[i] = entry
        return SamplerOutput(token_list, logprobs)


# --------------------------------------------------------------------------- logprobs


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, ks: Sequence[int]) -> list[TokenLogprob]:
    """Per row of ``logprobs`` [N, V]: the chosen token's logprob, its rank and the top ``ks[row]``."""
    chosen = chosen.to(device=logprobs.device, dtype=torch.long).view(-1, 1)
    chosen_lp = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    k_max = min(max(ks, default=0), logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in ks]
    top_ids: list[list[int]] = [[] for _ in ks]
    if k_max > 0:
        top = logprobs.topk(k_max, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprob(token_id=t, logprob=lp, rank=rank, top=list(zip(ids[:k], values[:k], strict=True)))
        for t, lp, rank, ids, values, k in zip(
            chosen.view(-1).tolist(), chosen_lp.view(-1).tolist(), ranks.tolist(),
            top_ids, top_values, ks, strict=True,
        )
    ]


def prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """Logprob of each actual next prompt token under ``logits`` [T, V], with its top ``k``.

    Row ``t`` of ``logits`` predicts ``next_token_ids[t]``. Computed in row chunks to
    bound memory on long prompts over large vocabularies.
    """
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(next_token_ids)} next tokens")
    targets = torch.tensor(list(next_token_ids), dtype=torch.long, device=logits.device)
    chunk = max(1, _PROMPT_LOGPROBS_CHUNK_ELEMENTS // max(1, logits.shape[1]))
    out: list[TokenLogprob] = []
    for start in range(0, logits.shape[0], chunk):
        lp = torch.log_softmax(logits[start:start + chunk].float(), dim=-1)
        piece = targets[start:start + chunk]
        out.extend(gather_logprobs(lp, piece, [k] * piece.shape[0]))
    return out


# --------------------------------------------------------------------------- logits processing


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]) -> None:
    """Stages 2-5 (bias, min_tokens, penalties, grammar), in place."""
    apply_logit_bias(logits, rows)
    min_token_rows = apply_min_tokens(logits, rows, eos_token_ids)
    apply_penalties(logits, rows)
    apply_grammar(logits, rows, eos_token_ids, min_token_rows)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_idx: list[int] = []
    tok_idx: list[int] = []
    values: list[float] = []
    for i, r in enumerate(rows):
        for token_id, bias in r.params.logit_bias.items():
            row_idx.append(i)
            tok_idx.append(int(token_id))
            values.append(float(bias))
    if row_idx:
        index = _index_tensors(row_idx, tok_idx, logits.device)
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device),
                          accumulate=True)


def apply_min_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]
) -> list[int]:
    """Block EOS and stop_token_ids for rows under their ``min_tokens``; return those rows."""
    vocab = logits.shape[1]
    blocked_rows: list[int] = []
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) >= r.params.min_tokens:
            continue
        blocked = set(eos_token_ids).union(t for t in r.params.stop_token_ids if 0 <= t < vocab)
        blocked_rows.append(i)
        row_idx.extend([i] * len(blocked))
        tok_idx.extend(blocked)
    if row_idx:
        logits.index_put_(_index_tensors(row_idx, tok_idx, logits.device),
                          torch.tensor(_NEG_INF, dtype=logits.dtype, device=logits.device))
    return blocked_rows


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition (prompt + output), then frequency and presence (output) penalties, in place.

    Works on the (row, token) pairs that occur, never on whole [B, V] rows: the cost is
    proportional to the number of tokens in the penalised sequences.
    """
    rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        seen = _unique_positions(
            rep_rows * 2,
            [rows[i].prompt_token_ids for i in rep_rows] + [rows[i].output_token_ids for i in rep_rows],
            logits.shape[1],
        )
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype)
        r_idx, t_idx = seen[0].to(logits.device), seen[1].to(logits.device)
        values = logits[r_idx, t_idx]
        factor = penalty.to(logits.device)[r_idx]
        logits[r_idx, t_idx] = torch.where(values > 0, values / factor, values * factor)
    additive = [
        i for i, r in enumerate(rows)
        if (r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0) and r.output_token_ids
    ]
    if additive:
        outputs = [rows[i].output_token_ids for i in additive]
        every = _positions(additive, outputs)  # one entry per occurrence: frequency
        unique = _unique_positions(additive, outputs, logits.shape[1])  # one per distinct token: presence
        freq = torch.tensor([-r.params.frequency_penalty for r in rows], dtype=logits.dtype)
        pres = torch.tensor([-r.params.presence_penalty for r in rows], dtype=logits.dtype)
        r_idx = torch.cat([every[0], unique[0]])
        t_idx = torch.cat([every[1], unique[1]])
        values = torch.cat([freq[every[0]], pres[unique[0]]])
        logits.index_put_((r_idx.to(logits.device), t_idx.to(logits.device)), values.to(logits.device),
                          accumulate=True)


def apply_grammar(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    eos_token_ids: Sequence[int],
    min_token_rows: Sequence[int] = (),
) -> None:
    """Mask tokens the rows' grammars disallow (rows without a grammar are untouched)."""
    grammar_rows = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not grammar_rows:
        return
    from llmkube.serving.engine.structured import allocate_bitmask, apply_bitmask

    bitmask = allocate_bitmask(len(rows), logits.shape[1])
    masked = [i for i in grammar_rows if rows[i].grammar.fill_bitmask(bitmask, i)]  # type: ignore[union-attr]
    if not masked:
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    apply_bitmask(logits, bitmask, masked)
    conflicted = sorted(set(masked).intersection(min_token_rows))
    if conflicted and eos_token_ids:
        # min_tokens blocked the only tokens the grammar allows (EOS after a complete
        # document): let the grammar win rather than leave the row without any token.
        dead = [i for i, d in zip(conflicted, torch.isneginf(logits[conflicted]).all(dim=-1).tolist(),
                                  strict=True) if d]
        if dead:
            row_idx = [i for i in dead for _ in eos_token_ids]
            tok_idx = [t for _ in dead for t in eos_token_ids]
            logits.index_put_(_index_tensors(row_idx, tok_idx, logits.device),
                              torch.tensor(0.0, dtype=logits.dtype, device=logits.device))
            apply_bitmask(logits, bitmask, dead)


# --------------------------------------------------------------------------- sampling


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Stage 6: one token id per row (int64 tensor on ``logits.device``)."""
    greedy = [r.params.temperature == 0.0 for r in rows]
    if all(greedy):
        return logits.argmax(dim=-1)
    random_idx = [i for i, g in enumerate(greedy) if not g]
    if len(random_idx) == len(rows):
        return _sample_random(logits, rows)
    tokens = logits.argmax(dim=-1)
    sampled = _sample_random(logits[random_idx], [rows[i] for i in random_idx])
    tokens[random_idx] = sampled
    return tokens


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p, then the exponential race; ``logits`` in place."""
    device = logits.device
    params = [r.params for r in rows]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits.div_(temperature.unsqueeze(1))
    if any(p.min_p > 0.0 for p in params):
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p): no softmax needed.
        log_min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device).log()
        threshold = logits.amax(dim=-1) + log_min_p
        logits.masked_fill_(logits < threshold.unsqueeze(1), _NEG_INF)
    _top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
    # The exponential race argmax(p_i / E_i) in log space: -log(E_i) is Gumbel(0, 1) noise,
    # so this is argmax(logit_i + G_i), the same draw without a softmax pass.
    return logits.sub_(_exponential_noise(logits, rows).log_()).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """Apply top_k and top_p to the rows that use them (sorting only if some row uses top_p)."""
    vocab = logits.shape[1]
    top_k = [k if 0 < k < vocab else 0 for k in top_k]
    idx = [i for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)) if k or p < 1.0]
    if not idx:
        return
    whole = len(idx) == len(top_k)
    sub = logits if whole else logits[idx]
    ks, ps = [top_k[i] for i in idx], [top_p[i] for i in idx]
    if any(p < 1.0 for p in ps):
        _top_p(sub, ks, ps)
    else:
        _top_k_only(sub, ks)
    if not whole:
        logits[idx] = sub


def _top_k_only(logits: torch.Tensor, top_k: list[int]) -> None:
    """Keep each row's ``k`` largest logits (0 = keep all) without sorting the vocabulary.

    Ties with the k-th value are kept, as in vLLM.
    """
    device = logits.device
    k_max = max(top_k)
    kth_values = logits.topk(k_max, dim=-1).values
    k = torch.tensor(top_k, dtype=torch.long, device=device)
    kth = kth_values.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
    kth = torch.where((k > 0).unsqueeze(1), kth, torch.full_like(kth, _NEG_INF))
    logits.masked_fill_(logits < kth, _NEG_INF)


def _top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """top_k then top_p, looking at each row's best candidates before sorting whole rows.

    A model's nucleus is usually a few dozen tokens: when a row's top candidates already
    hold mass >= p (or the row's top_k set is among them), the filter is decided there
    and the row is never sorted; only the other rows take the full sort. Kept set: the
    tokens whose strictly-better mass is < p (the best token always stays), which is
    what ``_top_k_top_p_sorted`` computes on the full sort.
    """
    vocab, device = logits.shape[1], logits.device
    num_candidates = max(_TOP_P_CANDIDATES, *top_k)
    if num_candidates * 4 > vocab:
        _top_k_top_p_sorted(logits, top_k, top_p)
        return
    values, indices = logits.topk(num_candidates, dim=-1)  # best first
    k = torch.tensor([t or num_candidates for t in top_k], dtype=torch.long, device=device)
    has_k = torch.tensor([t > 0 for t in top_k], device=device)
    values.masked_fill_(torch.arange(num_candidates, device=device) >= k.unsqueeze(1), _NEG_INF)
    # Mass relative to the top_k set when the row has one, else to the whole row.
    normaliser = torch.where(has_k, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - normaliser.unsqueeze(1)).exp()
    cumulative = probs.cumsum(dim=-1)
    p = torch.tensor(top_p, dtype=logits.dtype, device=device)
    keep = ((cumulative - probs) < p.unsqueeze(1)) | (p >= 1.0).unsqueeze(1)
    keep[:, 0] = True
    decided = (has_k | (cumulative[:, -1] >= p)).tolist()
    undecided = [i for i, d in enumerate(decided) if not d]
    fallback = None
    if undecided:
        fallback = logits[undecided]
        _top_k_top_p_sorted(fallback, [top_k[i] for i in undecided], [top_p[i] for i in undecided])
    kept = values.masked_fill_(~keep, _NEG_INF)
    logits.fill_(_NEG_INF).scatter_(1, indices, kept)
    if fallback is not None:
        logits[undecided] = fallback


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """top_k then top_p (nucleus) on one ascending sort of each row, in place."""
    device, vocab = logits.device, logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)
    if any(top_k):
        k = torch.tensor([t or vocab for t in top_k], dtype=torch.long, device=device)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    p = torch.tensor(top_p, dtype=logits.dtype, device=device).unsqueeze(1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose total mass is at most 1 - p; the best token always stays.
    drop = cumulative <= 1.0 - p
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    logits.scatter_(1, order, sorted_logits)


def _exponential_noise(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Exponential(1) noise per row, as -log(U): from the row's own generator if it has one.

    Drawn from uniforms because CPU ``exponential_`` is ~3.5x slower than ``rand`` + log
    (the distribution is the same). A seeded row always draws exactly V uniforms per
    step, so its stream is independent of the batch.
    """
    noise = torch.empty_like(logits)
    seeded = [(i, r.generator) for i, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < len(rows):
        noise.uniform_()
    vocab = logits.shape[1]
    for i, generator in seeded:
        draw = torch.rand(vocab, dtype=logits.dtype, device=generator.device, generator=generator)
        noise[i].copy_(draw, non_blocking=True)
    return noise.log_().neg_()


# --------------------------------------------------------------------------- helpers


def _index_tensors(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.tensor([rows, cols], dtype=torch.long, device=device)
    return both[0], both[1]


def _positions(row_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, tokens) CPU index tensors with one entry per token of ``token_lists[j]`` in row ``row_ids[j]``."""
    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(lengths.sum()))
    row_index = np.repeat(np.asarray(row_ids, dtype=np.int64), lengths)
    return torch.from_numpy(row_index), torch.from_numpy(tokens)


def _unique_positions(
    row_ids: Sequence[int], token_lists: Sequence[Sequence[int]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``_positions`` with each (row, token) pair once."""
    row_index, tokens = _positions(row_ids, token_lists)
    flat = torch.unique(row_index * vocab + tokens)
    return flat // vocab, flat % vocab
