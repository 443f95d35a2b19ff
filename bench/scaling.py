"""The scaling suite: ring attention (``cuflash.distributed``) over 1, 2, 4 and 8 GPUs of one host, one process
per GPU with a NCCL communicator (one GPU: a local one, nothing moves, no NCCL needed), at 128k-1M tokens,
causal (zigzag shards) and not.

A record's impl is the GPU count ("4 GPUs"); its TFLOP/s are per GPU: the whole sequence's FLOPs (4 * heads *
head_dim * score entries, causal n (n + 1) / 2; fwd+bwd 3.5x) over the time, divided by the GPU count. The time
of a repeat is the slowest rank's, each rank timing its call with CUDA events after a NCCL barrier. "N GPUs, no
moves" records run the same calls with a communicator that moves nothing (each rank computes on its own keys
where the ring would have brought another's): the time the moves cost is the difference. World size 1 is
``cuflash.attention`` itself. bfloat16, batch 1, 32 heads x 128, MHA (the most bytes per move); no L2 flush
(a rank's shards are gigabytes). Results are not checked here: tests/test_distributed.py checks the ring over
NCCL against the reference.
"""

from __future__ import annotations

import multiprocessing
import queue

from cuflash.distributed import LocalCommunicator

from .records import Shape, make_record

SCALING_DTYPE = "bfloat16"
SCALING_HEADS, SCALING_HEAD_DIM = 32, 128
SCALING_TOKENS = (131072, 262144, 524288, 1048576)
QUICK_SCALING_TOKENS = (524288,)
SCALING_GPUS = (1, 2, 4, 8)
SCALING_PASSES = ("fwd", "fwd+bwd")
#: The longest shard a rank takes: at 512k tokens the fwd+bwd holds q, k, v, out, dout (bfloat16) and its float32
#: dq, dk, dv sums and merges, about 50 GiB at 32 x 128; twice that leaves too little of an H200 for the moves.
MAX_TOKENS_PER_GPU = 524288
#: seconds without a result from any rank before the run is given up (a cell of 1M tokens takes minutes)
RANK_TIMEOUT_S = 1800
#: seconds between looks at the ranks' results and exit codes
POLL_S = 5.0


class StillCommunicator(LocalCommunicator):
    """A communicator that moves nothing: the ring's calls without its moves (the receive buffers keep what
    they hold, the timing does not depend on it)."""

    def __init__(self, rank: int, world_size: int):
        super().__init__(None, rank, world_size)

    def shift(self, sends, recvs, tag=None):
        pass


def scaling_cells(quick: bool, gpu_count: int) -> list[tuple[int, int, bool, str]]:
    """(GPUs, tokens, causal, pass) of each cell this host can run: every GPU count up to ``gpu_count``, the
    shards no longer than MAX_TOKENS_PER_GPU; --quick: causal forward at 512k tokens."""
    tokens = QUICK_SCALING_TOKENS if quick else SCALING_TOKENS
    masks = (True,) if quick else (False, True)
    passes = SCALING_PASSES[:1] if quick else SCALING_PASSES
    return [(gpus, n, causal, pass_) for gpus in SCALING_GPUS if gpus <= gpu_count for n in tokens
            if n // gpus <= MAX_TOKENS_PER_GPU for causal in masks for pass_ in passes]


def shape_of(tokens: int) -> Shape:
    return Shape(1, tokens, tokens, SCALING_HEADS, SCALING_HEADS, SCALING_HEAD_DIM)


def per_gpu_entries(tokens: int, causal: bool, gpus: int) -> float:
    """Score entries of the whole sequence per head, over the GPUs (make_record's ``visible``)."""
    return (tokens * (tokens + 1) / 2 if causal else float(tokens) * tokens) / gpus


def records_of(gpus: int, tokens: int, causal: bool, pass_: str, ring_ms: list[float],
               still_ms: list[float] | None) -> list[dict]:
    """The records of one cell: the ring's, and where measured its calls without the moves."""
    name = f"{gpus} GPU" + ("s" if gpus > 1 else "")
    entries = per_gpu_entries(tokens, causal, gpus)
    records = [make_record(name, pass_, SCALING_DTYPE, shape_of(tokens), causal, times_ms=ring_ms, visible=entries)]
    if still_ms is not None:
        records.append(make_record(f"{name}, no moves", pass_, SCALING_DTYPE, shape_of(tokens), causal,
                                   times_ms=still_ms, visible=entries,
                                   note="the ring's calls on a communicator that moves nothing"))
    return records


def _rank_main(rank: int, gpus: int, nccl_id, cells, warmup: int, repeats: int, results):
    """One rank: per cell, the slowest-rank timing needs every rank's times, so each rank puts its own
    (cell index, rank, ring ms, still ms) on ``results``."""
    import cupy

    from cuflash import distributed

    from .impls import make_inputs

    cupy.cuda.Device(rank).use()
    if gpus == 1:   # nothing moves: no NCCL needed (one GPU's baseline runs where CuPy has no NCCL)
        comm = distributed.local_communicators(1)[0]

        def barrier():
            pass
    else:
        from cupy.cuda import nccl

        comm = nccl.NcclCommunicator(gpus, nccl_id, rank)
        barrier_word = cupy.zeros(1, cupy.float32)

        def barrier():
            comm.allReduce(barrier_word.data.ptr, barrier_word.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           cupy.cuda.get_current_stream().ptr)

    still = StillCommunicator(rank, gpus)
    for index, (_, tokens, causal, pass_) in enumerate(cells):
        x = make_inputs(Shape(1, tokens // gpus, tokens // gpus, SCALING_HEADS, SCALING_HEADS, SCALING_HEAD_DIM),
                        SCALING_DTYPE, seed=rank)

        def call(on):
            out, lse = distributed.ring_attention(x.q, x.k, x.v, on, causal, return_lse=True)
            if pass_ == "fwd+bwd":
                distributed.ring_attention_backward(x.dout, x.q, x.k, x.v, out, lse, on, causal)

        times = []
        for on in (comm, still) if gpus > 1 else (comm,):
            ms = []
            for i in range(warmup + repeats):
                barrier()
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                call(on)
                end.record()
                end.synchronize()
                if i >= warmup:
                    ms.append(cupy.cuda.get_elapsed_time(start, end))
            times.append(ms)
        results.put((index, rank, times[0], times[1] if gpus > 1 else None))
        del x


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Per repeat, the slowest rank's milliseconds."""
    return [max(times) for times in zip(*per_rank)]


def run(quick: bool, warmup: int, repeats: int) -> list[dict]:
    """Every cell this host can run, a process per GPU per GPU count; the records."""
    import cupy
    from tqdm import tqdm

    cells = scaling_cells(quick, cupy.cuda.runtime.getDeviceCount())
    context = multiprocessing.get_context("spawn")
    records = []
    for gpus in sorted({c[0] for c in cells}):
        mine = [c for c in cells if c[0] == gpus]
        results = context.Queue()
        nccl_id = None
        if gpus > 1:
            from cupy.cuda import nccl

            nccl_id = nccl.get_unique_id()
        ranks = [context.Process(target=_rank_main, args=(r, gpus, nccl_id, mine, warmup, repeats, results))
                 for r in range(gpus)]
        for p in ranks:
            p.start()
        got: dict = {}
        try:
            with tqdm(total=len(mine) * gpus, desc=f"scaling {gpus} GPU(s)", unit="rank-cell") as bar:
                waited = 0.0
                while len(got) < len(mine) * gpus:
                    try:
                        index, rank, ring_ms, still_ms = results.get(timeout=POLL_S)
                    except queue.Empty:
                        waited += POLL_S
                        if waited > RANK_TIMEOUT_S or any(p.exitcode for p in ranks):
                            raise RuntimeError(f"scaling: the ranks of {gpus} GPU(s) stopped giving results (exit "
                                               f"codes {[p.exitcode for p in ranks]})") from None
                        continue
                    got[index, rank] = (ring_ms, still_ms)
                    waited = 0.0
                    bar.update()
        finally:
            for p in ranks:   # ranks left waiting in NCCL on a failed one are stopped
                p.join(timeout=None if len(got) == len(mine) * gpus else 0)
                if p.is_alive():
                    p.kill()
        for index, (_, tokens, causal, pass_) in enumerate(mine):
            ring_ms = slowest([got[index, r][0] for r in range(gpus)])
            still_ms = slowest([got[index, r][1] for r in range(gpus)]) if gpus > 1 else None
            records += records_of(gpus, tokens, causal, pass_, ring_ms, still_ms)
    return records
