"""A step captured as a CUDA graph on CUDA, the same function run eagerly elsewhere."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(
    step: Callable[[], None], device: torch.device, graphs: bool = True, reset: Callable[[], object] | None = None
) -> Callable[[], None]:
    """`step` as a CUDA graph's replay (its own memory pool: steps meet only through static buffers), or run
    eagerly where there are no graphs (`graphs` false, or not CUDA). `reset` runs before each warm-up and the
    capture (the buffers a step advances, e.g. the loop's start), so that the capture records a valid state."""

    def eager() -> None:
        with torch.inference_mode():
            step()

    if not graphs or device.type != "cuda":
        return eager
    with torch.inference_mode():  # the buffers are inference tensors: touched only in inference mode
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (kernel selection, lazy initialisation)
                if reset:
                    reset()
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        if reset:
            reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        if reset:
            reset()
    return graph.replay
