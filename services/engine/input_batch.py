"""The model runner's persistent batch: what it knows of each request it runs, kept in arrays
between steps (vLLM v1's ``InputBatch``).

A request gets a row the first time it is scheduled: its tokens, block table and sampling
settings are copied in once. After that a step only reads a few counters per scheduled request
(``num_computed_tokens``, tokens scheduled, ``num_tokens``, the block table's length) and
copies what changed: the tail of a block table that grew, tokens appended by someone other than
this runner (a remote prefill's first token). Everything else (input ids, positions, slot
mapping, block tables, sampling settings, the random draws) is gathered from the arrays with a
few vectorised operations whose number does not depend on the batch size. Sampled tokens are
written back into the rows by ``record_sampled``. Rows of finished requests are freed when the
scheduler reports them (``SchedulerOutput.finished_req_ids``).

Contract with the block manager: a request's ``block_table`` list is only appended to while it
lives; freeing replaces it with a new list (``BlockManager.free``), which is how a preempted
request's new table is told from its old one (by identity).
"""
from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from operator import is_

import numpy as np
import torch

from .attention import AttentionMetadata
from .grammars import Matchers
from .request import (Request, RequestStatus, block_table_of, num_computed_of, num_tokens_of,
                      request_id_of, status_of)
from .sampler import Penalties, RandomDraws, SamplingBatch, uniforms
from .scheduler import SchedulerOutput


@dataclass
class PromptLogprobsPlan:
    """Where a step computes prompt logprobs: the logits of the token before each prompt token
    of the step's chunks, for the requests that asked (``prompt_logprobs``)."""

    indices: torch.Tensor  # [m] rows of the hidden states (the token before each target)
    targets: torch.Tensor  # [m] int64: the prompt tokens whose logprob is asked
    owners: list[tuple[int, int, int]]  # (index in out.scheduled, targets, its top-N), in order
    num_top: int  # largest top-N asked for


@dataclass
class ModelInputs:
    """One step's flattened ragged batch (no padding), decode rows first."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    order: list[int]  # batch row -> index in SchedulerOutput.scheduled
    logits_indices: torch.Tensor  # [num_sampled] rows of the hidden states to sample from
    sampled_rows: list[int]  # batch rows that sample, aligned with logits_indices
    rows: np.ndarray  # [num_seqs] int64: each batch row's row in the InputBatch
    prompt_logprobs: PromptLogprobsPlan | None = None
    graph: tuple[str, int] | None = None  # the CUDA graph whose buffers hold these inputs


# CUDAGraphRunner.stage: (host arrays, input ids on the device) -> (graph key, device inputs)
Stage = Callable[[dict[str, np.ndarray], "torch.Tensor | None"],
                 "tuple[tuple[str, int], dict[str, torch.Tensor]] | None"]


def to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """The arrays as tensors on ``device``: on a CPU, views of them (no copy); elsewhere all of
    them packed into one pinned host buffer and sent in one asynchronous copy, so building a
    step's inputs never waits for the device (a copy from pageable memory would first wait for
    the stream's queued work)."""
    if device.type == "cpu":
        return {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
    host, layout = pack(arrays, pin=True)
    return unpack(host.to(device, non_blocking=True), layout)


Layout = dict[str, tuple[int, np.dtype, tuple[int, ...]]]  # name -> (byte offset, dtype, shape)


def pack(arrays: dict[str, np.ndarray], pin: bool) -> tuple[torch.Tensor, Layout]:
    """The arrays' bytes in one ``uint8`` tensor (pinned if ``pin``), each part 8-byte aligned,
    and where each one lies."""
    layout, total = {}, 0
    for k, a in arrays.items():
        layout[k] = (total, a.dtype, a.shape)
        total += -(-a.nbytes // 8) * 8
    host = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    packed = host.numpy()
    for k, a in arrays.items():
        offset = layout[k][0]
        packed[offset:offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return host, layout


def unpack(buffer: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """``pack``'s parts as typed views of ``buffer`` (a copy of its tensor, on any device)."""
    out = {}
    for k, (offset, dtype, shape) in layout.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        dt = torch.from_numpy(np.empty(0, dtype)).dtype
        out[k] = buffer[offset:offset + nbytes].view(dt).view(shape)
    return out


class InputBatch:
    """Per-request arrays, one row per request seen and not yet finished.

    ``max_model_len``: tokens a row holds; ``block_size``: tokens per KV block;
    ``vocab_size``: the model's, for checking stop token ids (an id outside it raises
    ``IndexError`` when its request is scheduled, so that request fails alone); ``device``:
    where the step's tensors go (``to_device``); ``matchers``: the grammar matchers of
    structured outputs (None: a request that asks for one fails alone).
    """

    def __init__(self, max_model_len: int, block_size: int, vocab_size: int,
                 device: torch.device | str = "cpu", capacity: int = 16,
                 matchers: Matchers | None = None) -> None:
        self.max_model_len, self.block_size, self.vocab_size = max_model_len, block_size, vocab_size
        self.device = torch.device(device)
        self.matchers = matchers
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> (ids, biases)
        self.max_blocks = -(-max_model_len // block_size)
        self.row_of: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._capacity = 0
        self._tables: list[list[int] | None] = []  # the block table list each row copied
        self._grow(capacity)

    # -- rows --------------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        """Make room for ``capacity`` rows (arrays keep their rows, new ones are empty)."""
        old = self._capacity

        def resized(a: np.ndarray | None, shape: tuple[int, ...], dtype, fill=0) -> np.ndarray:
            new = np.full(shape, fill, dtype=dtype)
            if a is not None:
                new[tuple(slice(0, n) for n in a.shape)] = a
            return new

        get = lambda name: getattr(self, name, None)  # noqa: E731
        n = capacity
        self.token_ids = resized(get("token_ids"), (n, self.max_model_len), np.int32)
        self.num_tokens = resized(get("num_tokens"), (n,), np.int64)  # tokens held in token_ids
        self.num_prompt = resized(get("num_prompt"), (n,), np.int64)
        self.output_from = resized(get("output_from"), (n,), np.int64)  # first output token
        self.block_table = resized(get("block_table"), (n, self.max_blocks), np.int64)
        self.num_blocks = resized(get("num_blocks"), (n,), np.int64)
        self.temperature = resized(get("temperature"), (n,), np.float32)  # 0: greedy
        self.top_p = resized(get("top_p"), (n,), np.float32, 1.0)
        self.top_k = resized(get("top_k"), (n,), np.int64)
        self.min_p = resized(get("min_p"), (n,), np.float32)
        self.presence = resized(get("presence"), (n,), np.float32)
        self.frequency = resized(get("frequency"), (n,), np.float32)
        self.repetition = resized(get("repetition"), (n,), np.float32, 1.0)
        self.has_penalties = resized(get("has_penalties"), (n,), np.bool_)
        self.seed = resized(get("seed"), (n,), np.uint64)
        self.prior_outputs = resized(get("prior_outputs"), (n,), np.int64)
        self.min_tokens = resized(get("min_tokens"), (n,), np.int64)
        # tokens held when the request ends by length: prompt + max_tokens, or max_model_len
        self.end_at = resized(get("end_at"), (n,), np.int64)
        self.num_logprobs = resized(get("num_logprobs"), (n,), np.int64, -1)  # -1: none
        self.constrained = resized(get("constrained"), (n,), np.bool_)  # structured output
        self.prompt_logprobs = resized(get("prompt_logprobs"), (n,), np.int64, -1)  # -1: none
        # NOTE: per-row summaries of the settings above, read every step (samples_alone,
        # plain_greedy): samples from its logits and settings alone; and by their argmax
        self.alone = resized(get("alone"), (n,), np.bool_)
        self.argmax = resized(get("argmax"), (n,), np.bool_)
        self.request_ids: list[str | None] = getattr(self, "request_ids", []) + [None] * (n - old)
        width = get("stop_ids").shape[1] if old else 1
        self.stop_ids = resized(get("stop_ids"), (n, width), np.int64, -1)  # EOS + stop ids
        self._tables.extend([None] * (n - old))
        self._free_rows.extend(range(n - 1, old - 1, -1))
        self._capacity = n

    def add(self, r: Request) -> int:
        """Give ``r`` a row and copy in its tokens and settings. Raises ``IndexError`` naming
        ``stop_token_ids`` or ``logit_bias`` for a token id outside the vocabulary."""
        p = r.sampling_params
        for field, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", [t for t, _ in p.logit_bias])):
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise IndexError(f"{field}: an id is outside the vocabulary [0, {self.vocab_size})")
        if not self._free_rows:
            self._grow(2 * self._capacity)
        if p.structured_output is not None:
            if self.matchers is None:
                raise ValueError("structured_output: this engine has no tokenizer for grammars")
            self.matchers.add(r.request_id, p.structured_output.format, p.structured_output.spec)
        row = self._free_rows.pop()
        self.row_of[r.request_id] = row
        self.request_ids[row] = r.request_id
        self.constrained[row] = p.structured_output is not None
        self.prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias)
            self.logit_bias[row] = (np.array(ids, dtype=np.int64), np.array(biases, dtype=np.float32))
        tokens = r.all_token_ids
        self.token_ids[row, :len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt[row] = r.num_prompt_tokens
        self.output_from[row] = r.num_prompt_tokens - p.num_prior_output_tokens
        self.block_table[row] = 0
        self.num_blocks[row] = 0
        self._tables[row] = None
        self.temperature[row] = 0.0 if p.greedy else p.temperature
        self.top_p[row], self.top_k[row], self.min_p[row] = p.top_p, p.top_k, p.min_p
        self.presence[row], self.frequency[row] = p.presence_penalty, p.frequency_penalty
        self.repetition[row], self.has_penalties[row] = p.repetition_penalty, p.has_penalties
        self.seed[row] = p.seed if p.seed is not None else secrets.randbits(64)
        self.prior_outputs[row] = p.num_prior_output_tokens
        self.min_tokens[row] = p.min_tokens
        self.end_at[row] = min(r.num_prompt_tokens + p.max_tokens, self.max_model_len)
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.alone[row] = alone = (not p.has_penalties and p.structured_output is None
                                   and p.logprobs is None)
        self.argmax[row] = alone and p.greedy and not p.logit_bias
        stops = list(p.stop_token_ids)
        if r.eos_token_id is not None and not p.ignore_eos:
            stops.append(r.eos_token_id)
        if len(stops) > self.stop_ids.shape[1]:
            wider = np.full((self._capacity, len(stops)), -1, dtype=np.int64)
            wider[:, :self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = wider
        self.stop_ids[row] = -1
        self.stop_ids[row, :len(stops)] = stops
        return row

    def remove(self, request_ids) -> None:
        """Free the rows of ``request_ids`` (unknown ids are ignored)."""
        for request_id in request_ids:
            row = self.row_of.pop(request_id, None)
            if row is not None:
                self._tables[row] = None
                self.logit_bias.pop(row, None)
                if self.constrained[row]:
                    self.matchers.remove(request_id)
                self.constrained[row] = False
                self.request_ids[row] = None
                self._free_rows.append(row)

    def _sync(self, r: Request, row: int) -> None:
        """Copy what changed in ``r`` since its row last saw it: appended tokens, and its block
        table (the tail when it grew, all of it when it was replaced)."""
        held = int(self.num_tokens[row])
        if r.num_tokens != held:
            self.token_ids[row, held:r.num_tokens] = r.token_slice(held, r.num_tokens)
            self.num_tokens[row] = r.num_tokens
        table, known = r.block_table, int(self.num_blocks[row])
        if table is not self._tables[row]:  # replaced (preempted): the old entries go
            self.block_table[row, :known] = 0
            self._tables[row], known = table, 0
        if len(table) != known:
            self.block_table[row, known:len(table)] = table[known:]
            self.num_blocks[row] = len(table)

    # -- one step ----------------------------------------------------------------------------
    def _rows_in_sync(self, reqs: list[Request]) -> tuple[np.ndarray, np.ndarray]:
        """Each request's row (added on its first step) and ``num_computed_tokens`` (``[n]``
        int64 each), after copying in what changed since its row last saw it (``_sync``).
        NOTE: the only work per request is reading its fields, each in one pass in C
        (``map``); the rows whose tokens or block table changed are found with array
        comparisons."""
        n = len(reqs)
        row_list = list(map(self.row_of.get, map(request_id_of, reqs)))
        if None in row_list:  # scheduled for the first time
            row_list = [self.add(r) if row is None else row for r, row in zip(reqs, row_list)]
        rows = np.array(row_list, np.int64)
        tables = list(map(block_table_of, reqs))
        stale = set(np.flatnonzero(
            (np.fromiter(map(num_tokens_of, reqs), np.int64, n) != self.num_tokens[rows])
            | (np.fromiter(map(len, tables), np.int64, n) != self.num_blocks[rows])).tolist())
        if not all(map(is_, tables, map(self._tables.__getitem__, row_list))):
            # replaced: preempted and rescheduled
            stale.update(i for i, (t, row) in enumerate(zip(tables, row_list))
                         if t is not self._tables[row])
        for i in sorted(stale):
            self._sync(reqs[i], row_list[i])
        return rows, np.fromiter(map(num_computed_of, reqs), np.int64, n)

    def prepare(self, out: SchedulerOutput, ahead_ids: torch.Tensor | None = None,
                stage: Stage | None = None) -> ModelInputs:
        """The model's inputs for ``out``, on the batch's device. Rows are added for requests
        seen for the first time (``add``: its errors propagate).

        ``stage`` (with CUDA graphs: ``CUDAGraphRunner.stage``): where a step's inputs go
        instead of ``to_device``, its arrays and ``ahead_ids`` given; it returns the graph's
        key and the inputs on the device, or None (``to_device`` then).

        ``ahead_ids`` (async scheduling): ``out`` decodes one token per request, and its first
        ``len(ahead_ids)`` requests' previous step is still running: their input tokens are
        that step's samples, still on the device (``[k]`` int64, in ``out.scheduled`` order),
        and every counter of theirs here and in the scheduler is one token behind."""
        self.remove(out.finished_req_ids)
        reqs, sched = out.scheduled, out.num_scheduled_tokens
        n = len(reqs)
        num_ahead = 0 if ahead_ids is None else ahead_ids.shape[0]
        rows, computed = self._rows_in_sync(reqs)
        computed[:num_ahead] += 1
        decode_only = len(sched) == n and sum(sched.values()) == n  # one token per row
        if decode_only:
            num_new = np.ones(n, np.int64)
            order = seq = np.arange(n)
            ends = order + 1
            starts, positions, token_rows = order, computed, rows
        else:
            # decode rows (one token) first: they take the batched decode attention path
            num_new = np.array([sched[r.request_id] for r in reqs], np.int64)
            order = np.argsort(num_new != 1, kind="stable")
            rows, num_new, computed = rows[order], num_new[order], computed[order]
            ends = np.cumsum(num_new)
            starts = ends - num_new
            seq = np.repeat(np.arange(n), num_new)  # [num_tokens] batch row of each token
            positions = computed[seq] + np.arange(int(ends[-1])) - starts[seq]
            token_rows = rows[seq]
        bs = self.block_size
        slots = self.block_table[token_rows, positions // bs] * bs + positions % bs
        seq_lens = computed + num_new
        width = int(-(-seq_lens.max() // bs))
        ahead = (np.arange(n) < num_ahead) if num_ahead else 0  # rows in out.scheduled order
        sampled = np.flatnonzero(seq_lens == self.num_tokens[rows] + ahead)
        query_start_loc = np.concatenate(([0], ends))
        arrays = {"positions": positions, "slot_mapping": slots, "seq_lens": seq_lens,
                  "block_tables": self.block_table[rows, :width],
                  "logits_indices": ends[sampled] - 1,
                  "query_start_loc": query_start_loc.astype(np.int32)}
        if num_ahead < n:
            arrays["input_ids"] = self.token_ids[token_rows[num_ahead:],
                                                 positions[num_ahead:]].astype(np.int64)
        num_decode = n if decode_only else int(np.count_nonzero(num_new == 1))
        graph, t = self._send(arrays, ahead_ids, stage)
        attn = AttentionMetadata(t["slot_mapping"], t["block_tables"], t["seq_lens"],
                                 query_start_loc.tolist(), num_decode)
        attn.set_query_start_loc_tensor(t["query_start_loc"])
        plan = None
        if (self.prompt_logprobs[rows] >= 0).any():
            plan = self._prompt_logprobs_plan(rows, order, computed, num_new, starts)
        return ModelInputs(t["input_ids"], t["positions"], attn, order.tolist(),
                           t["logits_indices"], sampled.tolist(), rows, plan, graph)

    def _send(self, arrays: dict[str, np.ndarray], ahead_ids: torch.Tensor | None,
              stage: Stage | None) -> tuple[tuple[str, int] | None, dict[str, torch.Tensor]]:
        """A step's arrays on the device: in a CUDA graph's buffers where ``stage`` takes them
        (and that graph's key), else ``to_device``'s (and None); ``ahead_ids`` are the
        first rows' input ids (one token per request: rows in ``out.scheduled`` order)."""
        staged = stage(arrays, ahead_ids) if stage is not None else None
        if staged is not None:
            return staged
        t = to_device(arrays, self.device)
        if ahead_ids is not None:
            t["input_ids"] = (ahead_ids if "input_ids" not in t
                              else torch.cat((ahead_ids, t["input_ids"])))
        return None, t

    def _prompt_logprobs_plan(self, rows: np.ndarray, order: np.ndarray, computed: np.ndarray,
                              num_new: np.ndarray, starts: np.ndarray) -> PromptLogprobsPlan | None:
        """Prompt token ``j`` (``j >= 1``) is scored by the logits at position ``j - 1``: for
        each chunk of an asking request that has produced no output yet, the positions
        ``[start, min(end, num_prompt - 1))``."""
        indices, targets, owners = [], [], []
        for b in np.flatnonzero((self.prompt_logprobs[rows] >= 0)
                                & (self.num_tokens[rows] == self.num_prompt[rows])).tolist():
            row, start = rows[b], int(computed[b])
            end = min(start + int(num_new[b]), int(self.num_prompt[row]) - 1)
            if end <= start:
                continue
            indices.append(np.arange(end - start) + starts[b])
            targets.append(self.token_ids[row, start + 1:end + 1].astype(np.int64))
            owners.append((int(order[b]), end - start, int(self.prompt_logprobs[row])))
        if not owners:
            return None
        t = to_device({"indices": np.concatenate(indices), "targets": np.concatenate(targets)},
                      self.device)
        return PromptLogprobsPlan(t["indices"], t["targets"], owners,
                                  int(self.prompt_logprobs[rows].max()))

    def sampling(self, rows: np.ndarray, ahead: int = 0) -> SamplingBatch:
        """Sampling settings of ``rows`` (the sampled rows, in logits order), on the batch's
        device in one copy; which rows each stage concerns is decided here, on the host.
        ``ahead``: tokens of each row sampled and not yet recorded (async scheduling)."""
        num_out = self.num_tokens[rows] - self.num_prompt[rows] + ahead  # this attempt's outputs
        a: dict[str, np.ndarray] = {}
        below = np.flatnonzero(num_out < self.min_tokens[rows])
        if below.size:  # min_tokens: EOS and stop ids masked
            ids = self.stop_ids[rows[below]]
            keep = ids >= 0
            a["suppress_rows"] = np.broadcast_to(below[:, None], ids.shape)[keep]
            a["suppress_ids"] = ids[keep]
        num_logprobs = self.num_logprobs[rows]
        if (num_logprobs >= 0).any():
            a["logprob_rows"] = np.flatnonzero(num_logprobs >= 0)
        if self.constrained[rows].any():
            self._grammar_arrays(rows, a)
        biased = [(i, self.logit_bias[row]) for i, row in enumerate(rows.tolist())
                  if row in self.logit_bias]
        if biased:
            a["bias_rows"] = np.concatenate([np.full(len(ids), i) for i, (ids, _) in biased])
            a["bias_ids"] = np.concatenate([ids for _, (ids, _) in biased])
            a["bias_values"] = np.concatenate([b for _, (_, b) in biased])
        if self.has_penalties[rows].any():
            self._penalty_arrays(rows, a)
        random = np.flatnonzero(self.temperature[rows] > 0)
        if random.size:
            self._random_arrays(rows, random, num_out[random], a)
        t = to_device(a, self.device)
        return SamplingBatch(
            random=RandomDraws(
                t["random_rows"], t["temperature"], t["top_p"], t["top_k"], t["min_p"],
                t["uniforms"], t.get("filter_rows"), bool((a["min_p"] > 0).any()),
            ) if random.size else None,
            penalties=Penalties(t["penalty_rows"], t["presence"], t["frequency"],
                                t["repetition"], t["history"], t["output_from"])
            if "penalty_rows" in t else None,
            suppress=(t["suppress_rows"], t["suppress_ids"]) if below.size else None,
            allowed=(t["allowed_rows"], t["allowed_bitmask"]) if "allowed_rows" in t else None,
            logit_bias=(t["bias_rows"], t["bias_ids"], t["bias_values"]) if biased else None,
            logprob_rows=t.get("logprob_rows"),
            max_num_logprobs=int(num_logprobs.max()) if "logprob_rows" in t else None)

    def _random_arrays(self, rows: np.ndarray, which: np.ndarray, num_out: np.ndarray,
                       a: dict[str, np.ndarray]) -> None:
        r = rows[which]
        top_p, top_k = self.top_p[r], self.top_k[r]
        a.update(random_rows=which, temperature=self.temperature[r], top_p=top_p, top_k=top_k,
                 min_p=self.min_p[r],
                 uniforms=uniforms(self.seed[r], num_out + self.prior_outputs[r]).astype(np.float32))
        filtered = (top_p < 1.0) | (top_k > 0)
        if filtered.any():
            a["filter_rows"] = np.flatnonzero(filtered)

    def _grammar_arrays(self, rows: np.ndarray, a: dict[str, np.ndarray]) -> None:
        """Each constrained row's allowed next tokens: its matcher first catches up with the
        output tokens it has not seen (sampled here last step, or handed over: a remote
        prefill's first token, a migrated request's earlier output)."""
        which = np.flatnonzero(self.constrained[rows])
        bitmask = np.zeros((which.size, self.matchers.words), dtype=np.int32)
        for k, row in enumerate(rows[which].tolist()):
            request_id = self.request_ids[row]
            self.matchers.advance(request_id, self.token_ids[row, self.output_from[row]:self.num_tokens[row]])
            self.matchers.fill(request_id, bitmask[k])
        a["allowed_rows"], a["allowed_bitmask"] = which, bitmask

    def _penalty_arrays(self, rows: np.ndarray, a: dict[str, np.ndarray]) -> None:
        which = np.flatnonzero(self.has_penalties[rows])
        r = rows[which]
        lengths = self.num_tokens[r]
        width = int(lengths.max())
        history = self.token_ids[r, :width].astype(np.int64)
        history[np.arange(width) >= lengths[:, None]] = -1
        a.update(penalty_rows=which, presence=self.presence[r], frequency=self.frequency[r],
                 repetition=self.repetition[r], history=history, output_from=self.output_from[r])

    def steps_ahead(self, rows: np.ndarray, reqs: list[Request]) -> list[int]:
        """Async scheduling: the indices of ``reqs`` (a launched decode step's, whose rows are
        ``rows``; its tokens not yet recorded here nor in the requests) that compute one more
        token in the step after it: running, and not ended by length by the launched step's
        token (``end_at``). A stop token is not known yet: such a request computes one token
        more, which the scheduler drops."""
        running = np.fromiter(map(status_of, reqs), np.int64, len(reqs)) == RequestStatus.RUNNING
        return np.flatnonzero(running & (self.num_tokens[rows] + 1 < self.end_at[rows])).tolist()

    def samples_alone(self, rows: np.ndarray) -> bool:
        """Whether every row of ``rows`` samples from its logits and settings alone: no
        penalties (they read the tokens so far), structured output (its matcher does) or
        logprobs, so that a step's tokens can be sampled before the last step's are read
        (async scheduling; ``sampling(rows, ahead)`` counts the tokens not yet read)."""
        return bool(self.alone[rows].all())

    def plain_greedy(self, rows: np.ndarray, ahead: int = 0) -> bool:
        """Whether every row of ``rows`` takes the argmax of its raw logits: greedy, no
        penalties, logit bias or structured output, no logprobs asked, and past ``min_tokens``
        (nothing masked) counting ``ahead`` tokens sampled and not yet recorded."""
        if not self.argmax[rows].all():
            return False
        min_tokens = self.min_tokens[rows]
        return not min_tokens.any() or bool(
            (self.num_tokens[rows] - self.num_prompt[rows] + ahead >= min_tokens).all())

    def record_sampled(self, rows: np.ndarray, token_ids: list[int]) -> list[bool]:
        """Append each row's sampled token (the scheduler appends the same to its request).

        Returns, per row, whether its new token may end its request: EOS or a stop id, or a
        length limit reached (``max_tokens``, ``max_model_len``). False is certain (the
        scheduler skips ``Request.check_stop``); True is for the scheduler to decide
        (``min_tokens`` may keep the request going)."""
        at = self.num_tokens[rows]
        tokens = np.asarray(token_ids, dtype=np.int64)
        keep = at < self.max_model_len
        self.token_ids[rows[keep], at[keep]] = tokens[keep]
        self.num_tokens[rows[keep]] += 1
        return ((at >= self.end_at[rows] - 1)
                | (self.stop_ids[rows] == tokens[:, None]).any(1)).tolist()
