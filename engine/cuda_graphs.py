"""CUDA graphs for decode-only steps: one graph per batch size of a fixed ladder, captured at
start-up over the model runner's persistent device buffers and replayed with the step's
inputs written into them, so a decode step costs one launch instead of hundreds.

Only the triton backend is captured: the torch backend plans each step from host-side lengths,
which a graph would freeze. This module never builds inputs (the runner does) and is never
used on the CPU.
"""

from __future__ import annotations

import bisect
import logging

import torch

from common.config import EngineConfig

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (padding stays under 16 rows
    for large batches and under 2x for tiny ones)."""
    ladder = [1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)]
    sizes = sorted({s for s in ladder if s <= max_num_seqs} | {max_num_seqs})
    return sizes


class DecodeGraphs:
    @classmethod
    def capture_if_enabled(cls, runner, config: EngineConfig) -> DecodeGraphs | None:
        if runner.device.type != "cuda" or not config.enable_cuda_graphs or config.enforce_eager:
            return None
        from engine.attention.triton_backend import TritonAttentionBackend

        if not isinstance(runner.model.backend, TritonAttentionBackend):
            logger.warning("CUDA graphs need attention_backend 'triton'; running decode eagerly")
            return None
        return cls(runner, graph_batch_sizes(config.max_num_seqs))

    def __init__(self, runner, sizes: list[int]) -> None:
        self.sizes = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        # Largest first, so the smaller graphs fit in the memory pool the largest one reserved.
        for size in reversed(sizes):
            ids, pos, meta = runner.placeholder_decode(size)
            with torch.inference_mode():
                # Warm up on a side stream (kernel compilation, library handles), then capture.
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    runner.run_model(ids, pos, meta)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = runner.run_model(ids, pos, meta)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", sizes)

    def size_for(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds num_reqs rows; None beyond the largest."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, size: int) -> torch.Tensor:
        """Runs the graph on what the runner wrote into its buffers; hidden states [size, H]."""
        self.graphs[size].replay()
        return self.outputs[size]
