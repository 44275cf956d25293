"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM's cudagraph
capture sizes: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs``).

A decode step of the built-in model is ~300 kernel launches; launching them from Python costs
more CPU time than the GPU spends running them at small batches. A CUDA graph records the
step's launches once and replays them with one call (NVIDIA's CUDA graphs; PyTorch's
``torch.cuda.CUDAGraph``). The graph reads its inputs from static device buffers (input ids,
positions, slot mapping, sequence lengths, block tables at the model's full width), so a step
copies its inputs into them (``stage``: one host-to-device copy) and replays the graph of the
smallest bucket that holds its batch.

Rows past the batch (the bucket's padding) repeat the batch's first row: they write the same
K/V values into the same slot and attend to the same context, so they change nothing and need
no special slot id in the kernels. Prefill and mixed steps run eagerly (their shapes vary too
much to capture). ``capture=False`` runs the same padded buffers eagerly: the same code path
without a GPU, for tests.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from .attention import AttentionMetadata
from .input_batch import ModelInputs

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, then multiples of 8, up to ``max_num_seqs``
    (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class CUDAGraphRunner:
    """Runs decode-only steps of ``model`` on padded static buffers, from captured graphs.

    ``kv_cache``: the engine's ``[num_layers, 2, num_blocks, block_size, kv_heads,
    head_dim]`` tensor; ``max_blocks``: block-table columns of the longest sequence.

    The buffers are one flat int64 device tensor: a staging area, then the block tables
    (``[max_num_seqs, max_blocks]``). The graph of batch size ``s`` reads its input ids,
    positions, slot mapping, sequence lengths and rows to sample (``[s]`` each) from the
    staging area's first ``5 * s`` entries, and its block tables from the first ``s`` rows.
    ``stage`` fills them with one host-to-device copy of a pinned buffer into the staging area
    (the block tables at the step's width, after the other inputs) and one device copy that
    spreads the block tables into their rows; the step's input ids come from the device where
    they are the step before's samples. Before, a step copied each input into its own buffer,
    and its padding apart: ~10 copies and ~30 tensor views, each a host call of microseconds
    (with async scheduling the host's time is what bounds a step at batch 64 on an H100).
    """

    FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices")

    def __init__(self, model, kv_cache: torch.Tensor, max_num_seqs: int, max_blocks: int,
                 capture: bool = True) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = max_blocks
        n, device = self.sizes[-1], kv_cache.device
        self.staging_size = n * (len(self.FIELDS) + max_blocks)
        self.buffer = torch.zeros(self.staging_size + n * max_blocks, dtype=torch.int64,
                                  device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.views = {size: self._views(size) for size in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self.capture()

    def _views(self, size: int) -> dict[str, torch.Tensor]:
        """The inputs of the graph of batch ``size``: views of ``buffer`` (the class
        docstring's layout)."""
        views = {name: self.buffer[i * size:(i + 1) * size] for i, name in enumerate(self.FIELDS)}
        views["block_tables"] = self.buffer[self.staging_size:].view(-1, self.max_blocks)[:size]
        return views

    def _forward(self, size: int) -> torch.Tensor:
        """The model on the buffers of batch ``size`` (all decode rows)."""
        v = self.views[size]
        meta = AttentionMetadata(v["slot_mapping"], v["block_tables"], v["seq_lens"],
                                 list(range(size + 1)), size)
        meta.set_query_start_loc_tensor(self.query_start_loc[:size + 1])
        return self.model(v["input_ids"], v["positions"], self.kv_cache, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture a graph per size, largest first (the smaller ones reuse its memory pool),
        each after two eager runs (Triton compiles, cuBLAS picks its kernels). The buffers
        hold zeros meanwhile (sequence lengths 1): every run writes block 0's first slot,
        which holds no request's KV before serving starts."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self.buffer.zero_()
                self.views[size]["seq_lens"].fill_(1)
                for _ in range(2):
                    self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._forward(size)
                self.graphs[size] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs of decode steps (batch sizes %s)", len(self.graphs),
                 ",".join(map(str, self.sizes)))

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest capture size that holds ``num_seqs``, or None."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def stage(self, arrays: dict[str, np.ndarray], ahead_ids: torch.Tensor | None,
              ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Copy a decode-only step's inputs into the buffers of the smallest graph that holds
        it; returns that batch size and the inputs as views of the buffers (what
        ``InputBatch.prepare`` would have sent: ``[n]`` each, block tables ``[n, width]``,
        ``query_start_loc`` ``[n + 1]`` int32), or None when no graph holds the batch.

        ``arrays`` (``InputBatch.prepare``'s, host): ``positions``, ``slot_mapping``,
        ``seq_lens``, ``logits_indices`` (``[<= n]``), ``block_tables`` ``[n, width]`` and,
        for the rows after the first ``len(ahead_ids)``, ``input_ids``; ``ahead_ids``: the
        first rows' input ids on the device (``[k]`` int64; async scheduling). Rows past the
        batch repeat its first row (module docstring). One pinned host buffer and one
        asynchronous copy (the caching host allocator keeps the buffer until the copy ran),
        one device copy for the block tables, one for ``ahead_ids`` (and one for their
        padding)."""
        n = arrays["seq_lens"].shape[0]
        size = self.bucket(n)
        if size is None or n == 0:
            return None
        k = 0 if ahead_ids is None else ahead_ids.shape[0]
        tables = arrays["block_tables"]
        width, num_fields = tables.shape[1], len(self.FIELDS)
        total = size * (num_fields + width)
        host = torch.empty(total, dtype=torch.int64, pin_memory=self.buffer.is_cuda)
        h = host.numpy()
        fields = h[:num_fields * size].reshape(num_fields, size)
        if k < n:
            fields[0, k:n] = arrays["input_ids"]
        for i, name in enumerate(self.FIELDS[1:4], 1):
            fields[i, :n] = arrays[name]
        fields[:4, n:] = fields[:4, :1]  # padding: the first row (its input id too if known)
        sampled = arrays["logits_indices"]
        fields[4, :sampled.shape[0]] = sampled
        staged_tables = h[num_fields * size:].reshape(size, width)
        staged_tables[:n] = tables
        staged_tables[n:] = tables[0]
        self.buffer[:total].copy_(host, non_blocking=True)
        v = self.views[size]
        # columns past ``width`` keep earlier steps' block ids, which no row reads (its
        # sequence length bounds it)
        v["block_tables"][:, :width].copy_(self.buffer[num_fields * size:total].view(size, width))
        if k:
            v["input_ids"][:k].copy_(ahead_ids)
            if size > n:
                v["input_ids"][n:].copy_(ahead_ids[:1].expand(size - n))
        t = {name: v[name][:n] for name in self.FIELDS[:4]} if n < size else dict(v)
        t["block_tables"] = v["block_tables"][:n, :width]
        t["logits_indices"] = v["logits_indices"][:sampled.shape[0]]
        t["query_start_loc"] = self.query_start_loc[:n + 1]
        return size, t

    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> torch.Tensor | None:
        """The hidden states ``[n, hidden]`` of a step whose inputs ``stage`` put in the
        buffers (``inputs.graph_size``), from its graph; None for any other step."""
        size = inputs.graph_size
        if size is None:
            return None
        n = inputs.input_ids.shape[0]
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
            return out[:n]
        return self._forward(size)[:n]
