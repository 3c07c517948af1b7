"""run.cuda_graph=true: the training step recorded once in one CUDA graph and replayed for every batch after, so
that a step is one launch from the host instead of hundreds (DDP's all-reduce inside it).

The eager step is host-bound on a GPU (configs/fast.yaml on an H100: 4.46 ms of kernels a step, 7.6 ms a step in
its epochs, bench/results/nvidia-h100-80gb-hbm3-check-2026-11-27-b.md); a replay does not wait on the host: on one
H200 a recorded step of fast at batch 1024 took 4.35 ms for 4.34 ms of kernels, and DDP at world size 1 added 0.7-2.4%
on the bench's rows (bench/results/nvidia-h200-check-2026-11-28.md).

What is recorded is the step's gradient part (train.gradient_step: zero_grad, the forward, the backward, the
gradients' norm and clipping, the optimizer's step) on static input buffers; the rest of a step (the schedule,
lookahead, the moving average, the step statistics) runs eagerly after each replay, as it does after an eager
step. A replay repeats the recorded kernels on the same tensors, so:
  - each batch is copied into the static buffers first; a batch of another shape (an epoch's last, short one)
    or a mixed one (MixUp/CutMix: its mix is drawn on the host) takes the eager step instead;
  - the learning rates are read from device tensors, filled with the schedule's values before each replay (the
    fused SGD step reads a tensor LR; recorded, a Python LR would stay the one of the recording);
  - an optimizer state replaced after the recording (a checkpoint or the warm-up's restore: load_state_dict
    makes new momentum tensors) drops the recording, and the step records again.
The first steps run eagerly before the recording: cuDNN's autotuning, the momentum buffers and DDP's buckets
settle in them (torch's CUDA-graph notes ask 11 DDP steps before a capture); the run is on a side stream, where
DDP is built too (the capture must not touch the default stream: stream()). checks.check_cuda_graph refuses
what a replay would get wrong or what is not recorded yet (accumulation, fp16's skipped steps, SyncBatchNorm, a
mix under DDP: a rank's eager all-reduce against another's recorded one, ...); run.cuda_graph=auto (configs/fast.yaml)
runs such a run's step eager instead, and records where nothing is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ddp.devices import World
from ddp.errors import UsageError, first_line, out_of_memory

EAGER_STEPS = {False: 1, True: 11}  # eager steps before the recording: one process, DDP (its buckets settle)

Pair = tuple[torch.Tensor, torch.Tensor]  # a gradient step's loss and norm, on the device
GradientStep = Callable[[torch.Tensor, torch.Tensor], Pair]
Say = Callable[[str], None]


@contextlib.contextmanager
def stream(on: bool, device: torch.device) -> Iterator[None]:
    """The run on a stream of its own when its step is to be recorded (the capture's stream: a capture on
    the default stream fails, and DDP built on another than its backward's breaks it)."""
    with torch.cuda.stream(torch.cuda.Stream(device)) if on and device.type == "cuda" else contextlib.nullcontext():
        yield


class Recorder:
    """The step of one run: eager until EAGER_STEPS, then recorded once and replayed. `gradient_step(images,
    labels)` returns the batch's mean loss and the gradients' norm, both on the device. On a GPU it records a
    CUDA graph; on a CPU a replay calls the step again on the same static buffers and tensor LRs (how the tests
    show that the buffers, the tensor LRs and the host part after them compute what the eager step does)."""

    def __init__(
        self, gradient_step: GradientStep, optimizer: torch.optim.Optimizer, world: World, say: Say | None = None
    ) -> None:
        self.gradient_step, self.optimizer, self.capture = gradient_step, optimizer, world.device.type == "cuda"
        self.eager_left, self.say = EAGER_STEPS[world.grouped], say
        self.steps = 0  # this process's steps through it
        self.replay: Callable[[], None] | None = None
        self.state: object = None  # the optimizer state the recording holds (its momentum tensors)
        self.inputs: Pair = ()  # type: ignore[assignment]
        self.outputs: Pair = ()  # type: ignore[assignment]
        self.lrs: list[torch.Tensor] = []
        self.replays = 0  # steps taken by a replay (the tests count them)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> Pair:
        """One step's gradient part on this batch: (loss, norm) on the device."""
        self.steps += 1
        if self.replay is not None and self.optimizer.state is not self.state:
            self.replay, self.eager_left = None, 1  # new momentum tensors: record again, after one eager step
        if self.replay is None and self.eager_left > 0 or (self.inputs and images.shape != self.inputs[0].shape):
            self.eager_left = max(0, self.eager_left - 1)
            return self.gradient_step(images, labels)
        if self.replay is None:
            self._record(images, labels)
        self.inputs[0].copy_(images, non_blocking=True)
        self.inputs[1].copy_(labels, non_blocking=True)
        for lr, group in zip(self.lrs, self.optimizer.param_groups, strict=True):
            lr.fill_(group["lr"])  # the schedule's LR of this step (a host-to-device write, no sync)
        self.replay()
        self.replays += 1
        return self.outputs[0].clone(), self.outputs[1]  # the loss outlives the next replay (the progress bar)

    def _record(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """The gradient step recorded on static copies of this batch, each group's LR a device tensor in it
        (recorded only: the call that records replays it next, as every later one does)."""
        device = self.optimizer.param_groups[0]["params"][0].device
        self.inputs = (images.to(device, copy=True), labels.to(device, copy=True))
        self.lrs = [torch.tensor(float(group["lr"]), device=device) for group in self.optimizer.param_groups]
        self.outputs = ()  # type: ignore[assignment]
        self.replay = self._capture() if self.capture else self._call_again
        self.state = self.optimizer.state
        if self.say:
            how = "in a CUDA graph" if self.capture else "(a CPU: replayed by calling it again)"
            self.say(f"run.cuda_graph: the step recorded {how} at this process's step {self.steps}; replayed from here")

    @contextlib.contextmanager
    def _tensor_lrs(self) -> Iterator[None]:
        """Each group's LR the device tensor while inside, its float again after (a checkpoint holds floats)."""
        floats = [group["lr"] for group in self.optimizer.param_groups]
        for lr, group in zip(self.lrs, self.optimizer.param_groups, strict=True):
            group["lr"] = lr
        try:
            yield
        finally:
            for group, lr in zip(self.optimizer.param_groups, floats, strict=True):
                group["lr"] = lr

    def _capture(self) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)  # autocast's cast weights must not outlive the capture
        try:
            # thread_local: another thread's CUDA calls (a DataLoader's pin-memory thread, NCCL's watchdog) are its own
            with self._tensor_lrs(), torch.cuda.graph(graph, stream=torch.cuda.current_stream(),
                                                      capture_error_mode="thread_local"):  # fmt: skip
                self.outputs = self.gradient_step(*self.inputs)
        except RuntimeError as e:  # an operation a capture does not allow (a sync, a host read): the step cannot be
            if out_of_memory(e):  # recorded; out of memory is said as it is said anywhere else
                raise
            raise UsageError(f"run.cuda_graph: this run's step could not be recorded in a CUDA graph "
                             f"({first_line(e)}); run.cuda_graph=false runs it eager") from e  # fmt: skip
        finally:
            torch.set_autocast_cache_enabled(cache)
        return graph.replay

    def _call_again(self) -> None:
        """A CPU's replay: the step called again on the static buffers and tensor LRs, into the same outputs."""
        with self._tensor_lrs():
            loss, norm = self.gradient_step(*self.inputs)
        if self.outputs:
            self.outputs[0].copy_(loss)
            self.outputs[1].copy_(norm)
        else:
            self.outputs = (loss, norm)
