"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM's cudagraph
capture sizes: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs``).

A decode step of the built-in model is ~300 kernel launches; launching them from Python costs
more CPU time than the GPU spends running them at small batches. A CUDA graph records the
step's launches once and replays them with one call (NVIDIA's CUDA graphs; PyTorch's
``torch.cuda.CUDAGraph``). The graph reads its inputs from static device buffers (input ids,
positions, slot mapping, sequence lengths, block tables at the model's full width), so a step
copies its inputs into them and replays the graph of the smallest bucket that holds its batch.

Rows past the batch (the bucket's padding) repeat the batch's first row: they write the same
K/V values into the same slot and attend to the same context, so they change nothing and need
no special slot id in the kernels. Prefill and mixed steps run eagerly (their shapes vary too
much to capture). ``capture=False`` runs the same padded buffers eagerly: the same code path
without a GPU, for tests.
"""
from __future__ import annotations

import logging

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
    ``run(inputs)`` returns the hidden states ``[num_seqs, hidden]`` of a decode-only step
    whose batch fits the largest bucket, else None (the caller runs the model eagerly).
    """

    def __init__(self, model, kv_cache: torch.Tensor, max_num_seqs: int, max_blocks: int,
                 capture: bool = True) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.sizes = capture_sizes(max_num_seqs)
        n, device = self.sizes[-1], kv_cache.device
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.zeros(n, **i64)
        self.seq_lens = torch.ones(n, **i64)
        self.block_tables = torch.zeros(n, max_blocks, **i64)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self.capture()

    def _forward(self, size: int) -> torch.Tensor:
        """The model on the buffers' first ``size`` rows (all decode rows)."""
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size],
                                 self.seq_lens[:size], list(range(size + 1)), size)
        meta.set_query_start_loc_tensor(self.query_start_loc[:size + 1])
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture a graph per size, largest first (the smaller ones reuse its memory pool),
        each after two eager runs (Triton compiles, cuBLAS picks its kernels). The buffers
        hold row 0's zeros meanwhile: every run writes block 0's first slot, which holds no
        request's KV before serving starts."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
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

    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> torch.Tensor | None:
        a = inputs.attn
        n = inputs.input_ids.shape[0]
        size = self.bucket(n)
        if size is None or a.num_decode_seqs != n or n == 0:
            return None
        width = a.block_tables.shape[1]
        for buffer, real in ((self.input_ids, inputs.input_ids), (self.positions, inputs.positions),
                             (self.slot_mapping, a.slot_mapping), (self.seq_lens, a.seq_lens)):
            buffer[:n].copy_(real, non_blocking=True)
            buffer[n:size].copy_(real[:1].expand(size - n), non_blocking=True)
        self.block_tables[:n, :width].copy_(a.block_tables, non_blocking=True)
        self.block_tables[n:size, :width].copy_(a.block_tables[:1].expand(size - n, width),
                                                non_blocking=True)
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
            return out[:n]
        return self._forward(size)[:n]
