"""Steps replayed from CUDA graphs: decode steps, one graph per batch-size bucket (vLLM's
cudagraph capture sizes: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs``); prefill
steps, one graph per token-count bucket (16, 32, 48, 64, 96, 128, ... up to 2,048); and mixed
steps, in pieces between their attention calls, per token-count bucket.

A forward pass of the built-in model is ~300 kernel launches; launching them from Python costs
more CPU time than the GPU spends running them, at small batches and on prompts of up to a
few thousand tokens alike (a 128-token prompt's eager prefill took ~23 ms on an H100, almost
all of it the host's: docs/benchmarks.md, GPU). A CUDA graph records the step's launches
once and replays them with one call (NVIDIA's CUDA graphs; PyTorch's ``torch.cuda.CUDAGraph``).
The graph reads its inputs from static device buffers (input ids, positions, slot mapping,
sequence lengths, query start offsets, block tables at the model's full width), so a step
copies its inputs into them (``stage``: one host-to-device copy) and replays the graph of the
smallest bucket that holds it.

Decode graphs: rows past the batch (the bucket's padding) attend to the batch's first row's
context at its position, from input id 0, and write no K/V (slot -1, which the cache write
skips, as a prefill graph's padding tokens): their outputs are dropped, and their input ids
need no copy from the step before's samples on the device. Every row of a decode step
samples, so its graph also runs the LM head, into one static ``[max_num_seqs, vocab]`` float32 tensor (two
launches and their host calls fewer a step; the logits are the same bits as the runner's own
head call, which prefill and mixed steps keep: they sample some rows only).

Prefill graphs (steps without decode rows, as a prefill worker's are; vLLM captures such steps
too, in its piecewise and full graph modes): a bucket of ``T`` tokens holds up to ``min(T,
max_num_seqs)`` sequences. Token rows past the step's write no K/V (slot -1, which the cache
write skips) and belong to no sequence; sequences past the step's have no query token (their
start offset is the step's token count), so the attention kernel gives them no work. The
attention grid is the bucket's (``max_query_len`` = T, every sequence slot); a sequence's
result does not depend on it (the same key tiles in the same order; a tile past a query's
position adds exact zeros). Prefill steps of more tokens than the largest bucket run eagerly.

Mixed steps (decode rows and prompt chunks together, a unified worker's steps under load) are
staged as prefill steps into the same buffers and replayed piecewise, as vLLM's piecewise CUDA
graphs do: per token bucket, the forward pass is captured as the graphs between its attention
calls (embedding to the first layer's rotary, then each layer's output projection, MLP and the
next layer's norms, projection and rotary, then the last layer's rest and the final norm), and
a replay runs each layer's attention eagerly between them, with the step's own metadata: the
decode kernel on the decode rows and the prefill kernel on the chunks, as an eager step runs
them. A layer's queries leave its graph in a static buffer and its attention output enters the
next one from another. So a mixed step costs a replay and one attention call per layer of host
launches instead of the whole forward's.

``capture=False`` runs the same padded buffers eagerly: the same code path without a GPU, for
tests.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from . import model as model_module
from .attention import AttentionMetadata, paged_attention
from .input_batch import ModelInputs

log = logging.getLogger(__name__)

MAX_CACHED_SHAPES = 1024  # step shapes whose buffer views ``stage`` keeps (a few KB each)

DECODE, PREFILL = "decode", "prefill"
GraphKey = tuple[str, int]  # (DECODE, batch size) or (PREFILL, tokens)
PREFILL_GRAPH_MAX_TOKENS = 2048  # larger prefill steps run eagerly: their GPU time dominates


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a decode graph: 1, 2, 4, then multiples of 8, up to
    ``max_num_seqs`` (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts that get a prefill graph: 16, 32, then each power of two and the midpoint
    above it (48, 64, 96, 128, 192, ...: a step pads by less than half), up to ``max_tokens``
    capped at ``PREFILL_GRAPH_MAX_TOKENS`` (the cap is always included)."""
    top = min(max_tokens, PREFILL_GRAPH_MAX_TOKENS)
    sizes, p = [16], 32
    while p < top:
        sizes += [s for s in (p, p + p // 2) if s < top]
        p *= 2
    return [s for s in sizes if s < top] + [top]


@dataclass(frozen=True)
class _Layout:
    """Where one graph's inputs sit in the flat int64 buffer: each field's (offset, length) in
    int64 entries (``query_start_loc`` holds int32 pairs), then the step's block tables as
    staged (``[seqs, width]``, the width of the step); the graph reads its block tables from
    the shared full-width area after every layout's staging area."""

    tokens: int  # token rows of the graph
    seqs: int  # sequence slots of the graph
    fields: dict[str, tuple[int, int]]
    tables: int  # offset of the staged block tables

    @classmethod
    def of(cls, kind: str, tokens: int, seqs: int) -> "_Layout":
        lengths = {"input_ids": tokens, "positions": tokens, "slot_mapping": tokens,
                   "seq_lens": seqs, "logits_indices": seqs}
        if kind == PREFILL:
            lengths["query_start_loc"] = (seqs + 2) // 2  # seqs + 1 int32
        fields, offset = {}, 0
        for name, n in lengths.items():
            fields[name] = (offset, n)
            offset += n
        return cls(tokens, seqs, fields, offset)

    def staging_size(self, max_blocks: int) -> int:
        return self.tables + self.seqs * max_blocks


@dataclass
class _Pieces:
    """A mixed step's forward pass over one token bucket as graphs between attention calls:
    replay ``graphs[i]``, then layer ``i``'s attention (``layers[i]``: its K and V caches,
    scale, window, softcap) from ``q`` into ``o``; the last graph leaves the hidden states in
    ``out`` (``[tokens, hidden]``)."""

    graphs: list
    layers: list[tuple[torch.Tensor, torch.Tensor, float, int | None, float | None]]
    q: torch.Tensor  # [tokens, num_heads, head_dim]: each graph's last write
    o: torch.Tensor  # [tokens, num_heads, head_dim]: the next graph's first read
    out: torch.Tensor


class CUDAGraphRunner:
    """Runs the steps of ``model`` on padded static buffers, from captured graphs (mixed steps
    in pieces).

    ``kv_cache``: the engine's ``[num_layers, 2, num_blocks, block_size, kv_heads,
    head_dim]`` tensor; ``max_blocks``: block-table columns of the longest sequence;
    ``max_prefill_tokens``: the most tokens of a prefill step (``max_num_batched_tokens``,
    at most ``max_blocks`` blocks of tokens; 0: no prefill graphs).

    The buffers are one flat int64 device tensor: a staging area, then the block tables
    (``[max_seqs, max_blocks]``). Each graph reads its fields from the staging area
    (``_Layout``) and its block tables from the first rows of the table area. ``stage`` fills
    them with one host-to-device copy of a pinned buffer into the staging area (the block
    tables at the step's width, after the other inputs) and one device copy that spreads the
    block tables into their rows; a decode step's input ids come from the device where they
    are the step before's samples. Before, a step copied each input into its own buffer, and
    its padding apart: ~10 copies and ~30 tensor views, each a host call of microseconds (with
    async scheduling the host's time is what bounds a step at batch 64 on an H100).
    """

    def __init__(self, model, kv_cache: torch.Tensor, max_num_seqs: int, max_blocks: int,
                 max_prefill_tokens: int = 0, capture: bool = True) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.max_blocks, self.max_num_seqs = max_blocks, max_num_seqs
        block_size = kv_cache.shape[3]
        self.sizes = capture_sizes(max_num_seqs)
        self.prefill_sizes = (prefill_capture_sizes(min(max_prefill_tokens, max_blocks * block_size))
                              if max_prefill_tokens else [])
        self.layouts: dict[GraphKey, _Layout] = {
            (DECODE, s): _Layout.of(DECODE, s, s) for s in self.sizes}
        self.layouts.update({(PREFILL, t): _Layout.of(PREFILL, t, min(t, max_num_seqs))
                             for t in self.prefill_sizes})
        device = kv_cache.device
        self.staging_size = max(lay.staging_size(max_blocks) for lay in self.layouts.values())
        max_seqs = max(lay.seqs for lay in self.layouts.values())
        self.buffer = torch.zeros(self.staging_size + max_seqs * max_blocks, dtype=torch.int64,
                                  device=device)
        self.query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.views = {key: self._views(key) for key in self.layouts}
        self._shapes: dict[tuple, tuple] = {}  # a step's shape -> its views (_step_views)
        # a decode graph's logits (``_decode_forward``), every bucket's in the first rows of one
        # [max_num_seqs, vocab] float32 tensor, made at the first decode step (the model's vocab)
        self.logits: torch.Tensor | None = None
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.pieces: dict[int, _Pieces] = {}  # token bucket -> a mixed step's graphs
        if capture:
            self.capture()

    def _views(self, key: GraphKey) -> dict[str, torch.Tensor]:
        """The inputs of graph ``key``: views of ``buffer`` (``_Layout``)."""
        lay = self.layouts[key]
        views = {name: self.buffer[a:a + n] for name, (a, n) in lay.fields.items()}
        if key[0] == PREFILL:
            views["query_start_loc"] = views["query_start_loc"].view(torch.int32)[:lay.seqs + 1]
        else:
            views["query_start_loc"] = self.query_start_loc[:lay.seqs + 1]
        views["block_tables"] = self.buffer[self.staging_size:].view(-1, self.max_blocks)[:lay.seqs]
        return views

    def _forward(self, key: GraphKey, query_start_loc: list[int] | None = None,
                 num_decode: int = 0) -> torch.Tensor:
        """The model on the buffers of graph ``key``. ``query_start_loc``: the sequences' row
        offsets on the host (a prefill graph's, padded; only the CPU's attention reads them:
        the graph's kernels read the device copy, and its grid is the bucket's);
        ``num_decode``: its first sequences that are decode rows (a mixed step, run eagerly)."""
        v, lay = self.views[key], self.layouts[key]
        if key[0] == DECODE:
            meta = AttentionMetadata(v["slot_mapping"], v["block_tables"], v["seq_lens"],
                                     list(range(lay.seqs + 1)), lay.seqs)
        else:
            meta = AttentionMetadata(v["slot_mapping"], v["block_tables"], v["seq_lens"],
                                     query_start_loc or [0] + [lay.tokens] * lay.seqs,
                                     num_decode)
            meta.set_max_query_len(lay.tokens)
        meta.set_query_start_loc_tensor(v["query_start_loc"])
        return self.model(v["input_ids"], v["positions"], self.kv_cache, meta)

    def _decode_forward(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode graph's work: the model on its buffers and the LM head after it, into the
        static ``logits`` (every row samples in a decode step; the head inside the graph saves
        the step its launches and their host calls). The hidden states ``[size, hidden]`` and
        the logits ``[size, vocab]`` float32."""
        hidden = self._forward(key)
        if self.logits is None:
            self.logits = torch.empty(self.max_num_seqs, self.model.config.vocab_size,
                                      dtype=torch.float32, device=hidden.device)
        return hidden, self.model.compute_logits(hidden, out=self.logits[:key[1]])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture a graph per bucket, the most tokens first (the smaller ones reuse its
        memory pool), each after two eager runs (Triton compiles, cuBLAS picks its kernels).
        Meanwhile a decode graph's buffers hold zeros (sequence lengths 1: every run writes
        block 0's first slot, which holds no request's KV before serving starts) and a prefill
        graph's one sequence of all its tokens, writing nothing (slot -1) and reading block 0.
        After each prefill graph, the same bucket's pieces for mixed steps."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for key in sorted(self.layouts, key=lambda k: -self.layouts[k].tokens):
                self._fill_for_capture(key)
                forward = self._decode_forward if key[0] == DECODE else self._forward
                for _ in range(2):
                    forward(key)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = forward(key)
                self.graphs[key] = (graph, out)
                if key[0] == PREFILL:
                    self._capture_pieces(key, pool)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs: decode steps of batch sizes %s, prefill steps of %s "
                 "tokens, and mixed steps of %s tokens in pieces", len(self.graphs),
                 ",".join(map(str, self.sizes)), ",".join(map(str, self.prefill_sizes)) or "no",
                 ",".join(map(str, self.pieces)) or "no")

    def _capture_pieces(self, key: GraphKey, pool) -> None:
        """Capture bucket ``key``'s forward pass as graphs between its attention calls
        (``_Pieces``): each attention call of the model ends the graph being captured (after
        copying its queries into the static ``q``) and begins the next, which reads the
        attention output from the static ``o``. NOTE: a failure is logged and leaves mixed
        steps eager (``--enforce-eager`` is the other way out): they were eager before."""
        cfg, tokens = self.model.config, key[1]
        if not self.pieces:  # the largest bucket comes first; the others use views
            shape = (tokens, cfg.num_attention_heads, cfg.head_dim)
            dtype = self.model.model.embed_tokens.weight.dtype
            self._q = torch.empty(shape, dtype=dtype, device=self.kv_cache.device)
            self._o = torch.zeros(shape, dtype=dtype, device=self.kv_cache.device)
        q, o = self._q[:tokens], self._o[:tokens]
        graphs, layers = [torch.cuda.CUDAGraph()], []

        def attention_break(q_layer, k_cache, v_cache, meta, scale, sliding_window=None,
                            softcap=None):
            q.copy_(q_layer)
            graphs[-1].capture_end()
            layers.append((k_cache, v_cache, scale, sliding_window, softcap))
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)
            return o

        model_module.paged_attention = attention_break
        try:
            graphs[0].capture_begin(pool=pool)
            try:
                out = self._forward(key)
            finally:
                graphs[-1].capture_end()
            self.pieces[tokens] = _Pieces(graphs, layers, q, o, out)
        except Exception:  # noqa: BLE001 - mixed steps stay eager, loudly
            log.exception("capturing mixed steps of %d tokens in pieces failed: they run eagerly",
                          tokens)
        finally:
            model_module.paged_attention = paged_attention

    def _replay_pieces(self, pieces: _Pieces, meta: AttentionMetadata) -> torch.Tensor:
        """A mixed step from its bucket's pieces, each layer's attention launched between them
        with the step's metadata ``meta``; the hidden states ``[tokens, hidden]``."""
        for graph, (k_cache, v_cache, scale, window, softcap) in zip(pieces.graphs, pieces.layers):
            graph.replay()
            paged_attention(pieces.q, k_cache, v_cache, meta, scale, window, softcap, out=pieces.o)
        pieces.graphs[-1].replay()
        return pieces.out

    def _fill_for_capture(self, key: GraphKey) -> None:
        self.buffer.zero_()
        v, lay = self.views[key], self.layouts[key]
        if key[0] == DECODE:
            v["seq_lens"].fill_(1)
            return
        v["positions"].copy_(torch.arange(lay.tokens))
        v["slot_mapping"].fill_(-1)
        v["seq_lens"][0] = lay.tokens
        v["query_start_loc"][1:] = lay.tokens

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest decode capture size that holds ``num_seqs``, or None."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def prefill_bucket(self, num_tokens: int) -> int | None:
        """The smallest prefill capture size that holds ``num_tokens``, or None."""
        return next((s for s in self.prefill_sizes if s >= num_tokens), None)

    def stage(self, arrays: dict[str, np.ndarray], ahead_ids: torch.Tensor | None,
              ) -> tuple[GraphKey, dict[str, torch.Tensor]] | None:
        """Copy a step's inputs into the buffers of the smallest graph that holds it (a mixed
        step: a prefill graph's, replayed in pieces); returns that graph's key and the inputs
        as views of the buffers
        (what ``InputBatch.prepare`` would have sent: ``[n]`` each per token or sequence,
        block tables ``[m, width]``, ``query_start_loc`` ``[m + 1]`` int32), or None when no
        graph holds the step.

        ``arrays`` (``InputBatch.prepare``'s, host): ``positions``, ``slot_mapping``
        (``[n]``), ``seq_lens`` (``[m]``), ``logits_indices`` (``[<= m]``), ``block_tables``
        ``[m, width]``, ``query_start_loc`` (``[m + 1]``; a step of as many tokens as
        sequences is decode-only, any other a prefill or mixed step) and, for
        the rows after the first ``len(ahead_ids)``, ``input_ids``; ``ahead_ids``: a decode
        step's first rows' input ids on the device (``[k]`` int64; async scheduling). Padding
        as the module docstring says. One pinned host buffer and one asynchronous copy (the
        caching host allocator keeps the buffer until the copy ran), one device copy for the
        block tables, one for ``ahead_ids``."""
        n, m = arrays["positions"].shape[0], arrays["seq_lens"].shape[0]
        decode = n == m
        size = self.bucket(n) if decode else self.prefill_bucket(n)
        if size is None or n == 0:
            return None
        key = (DECODE if decode else PREFILL, size)
        lay = self.layouts[key]
        k = 0 if ahead_ids is None else ahead_ids.shape[0]
        tables, sampled = arrays["block_tables"], arrays["logits_indices"]
        width = tables.shape[1]
        rows = lay.seqs if decode else m  # block-table rows staged (decode: with padding)
        total = lay.tables + rows * width
        host = torch.empty(total, dtype=torch.int64, pin_memory=self.buffer.is_cuda)
        h = host.numpy()
        staged_tables = h[lay.tables:total].reshape(rows, width)
        staged_tables[:m] = tables
        if decode:
            self._fill_decode(h[:lay.tables].reshape(5, size), arrays, n, k)
            staged_tables[m:] = tables[0]
        else:
            self._fill_prefill(h, lay, arrays, n, m)
        staged, tables_to, tables_from, ids_to, t = self._step_views(
            key, n, m, rows, width, sampled.shape[0], k)
        staged.copy_(host, non_blocking=True)
        # columns past ``width`` keep earlier steps' block ids, which no row reads (its
        # sequence length bounds it); so do a prefill graph's rows past the step's
        tables_to.copy_(tables_from)
        if k:
            ids_to.copy_(ahead_ids)
        return key, dict(t)

    def _step_views(self, key: GraphKey, n: int, m: int, rows: int, width: int,
                    num_sampled: int, k: int) -> tuple:
        """The views of ``buffer`` that ``stage`` copies into and returns for a step of this
        shape: the staged part, the block tables' destination and source, the first ``k``
        input ids, and the step's inputs (``stage``'s dict). Made once per shape and kept
        (a decode chain's steps share one): each view is a host call of its own."""
        shape = (key, n, m, rows, width, num_sampled, k)
        found = self._shapes.get(shape)
        if found is not None:
            return found
        if len(self._shapes) >= MAX_CACHED_SHAPES:
            self._shapes.clear()
        lay, v = self.layouts[key], self.views[key]
        total = lay.tables + rows * width
        if n == lay.tokens and m == lay.seqs:  # a decode step that fills its bucket
            t = dict(v)
        else:
            t = {name: v[name][:n] for name in ("input_ids", "positions", "slot_mapping")}
            t["seq_lens"], t["query_start_loc"] = v["seq_lens"][:m], v["query_start_loc"][:m + 1]
        t["block_tables"] = v["block_tables"][:m, :width]
        t["logits_indices"] = v["logits_indices"][:num_sampled]
        found = self._shapes[shape] = (
            self.buffer[:total], v["block_tables"][:rows, :width],
            self.buffer[lay.tables:total].view(rows, width), v["input_ids"][:k], t)
        return found

    @staticmethod
    def _fill_decode(fields: np.ndarray, arrays: dict[str, np.ndarray], n: int, k: int) -> None:
        """A decode step's fields (``fields``: the host buffer's 5 rows of the bucket's size,
        in ``_Layout``'s order) but the first ``k`` input ids (on the device); padding: the
        first row's position and context, input id 0 and no K/V written (slot -1)."""
        if k < n:
            fields[0, k:n] = arrays["input_ids"]
        for i, name in enumerate(("positions", "slot_mapping", "seq_lens"), 1):
            fields[i, :n] = arrays[name]
        fields[:4, n:] = fields[:4, :1]
        fields[0, n:] = 0  # any token: a padding row's output is dropped
        fields[2, n:] = -1
        sampled = arrays["logits_indices"]
        fields[4, :sampled.shape[0]] = sampled

    @staticmethod
    def _fill_prefill(h: np.ndarray, lay: _Layout, arrays: dict[str, np.ndarray], n: int,
                      m: int) -> None:
        """A prefill step's fields in the host buffer ``h``; padding: tokens of no sequence
        writing nothing (slot -1), sequences of no token (offset ``n``, length 0)."""
        def field(name: str) -> np.ndarray:
            a, length = lay.fields[name]
            return h[a:a + length]

        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1)):
            field(name)[:n] = arrays[name]
            field(name)[n:] = pad
        field("seq_lens")[:m] = arrays["seq_lens"]
        field("seq_lens")[m:] = 0
        sampled = arrays["logits_indices"]
        field("logits_indices")[:sampled.shape[0]] = sampled
        qsl = field("query_start_loc").view(np.int32)[:lay.seqs + 1]
        qsl[:m + 1] = arrays["query_start_loc"]
        qsl[m + 1:] = n

    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The hidden states ``[n, hidden]`` of a step whose inputs ``stage`` put in the
        buffers (``inputs.graph``), from its graph, and a decode step's logits (``[n, vocab]``
        float32, every row's; None for a prefill or mixed step); None for any other step.
        A decode step's logits are the static ``logits``: the next decode step overwrites them
        (after, on the stream, what this step queued on them)."""
        key = inputs.graph
        if key is None:
            return None
        n, num_decode = inputs.input_ids.shape[0], inputs.attn.num_decode_seqs
        if key[0] == PREFILL and num_decode:  # a mixed step
            pieces = self.pieces.get(key[1])
            if pieces is not None:
                return self._replay_pieces(pieces, inputs.attn)[:n], None
            if self.graphs:  # captured, but not this bucket's pieces (logged): eager, on
                return None  # the buffers' views
        elif key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
            return (out[0][:n], out[1][:n]) if key[0] == DECODE else (out[:n], None)
        if key[0] == DECODE:  # run eagerly (capture=False)
            hidden, logits = self._decode_forward(key)
            return hidden[:n], logits[:n]
        # the CPU's attention reads these
        qsl = inputs.attn.query_start_loc
        qsl = qsl + [qsl[-1]] * (self.layouts[key].seqs + 1 - len(qsl))
        return self._forward(key, qsl, num_decode)[:n], None
