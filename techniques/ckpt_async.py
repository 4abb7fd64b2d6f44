"""
Checkpoints written in the background (ckpt_async=True). A save copies the weights and optimizer
state to CPU memory (the loop pauses only for that) and a thread writes and hashes the files while
training goes on; once every rank has written its part, the ranks finish it together and it
becomes the latest. Until then `latest` names the previous checkpoint: a crash mid-write loses
only the new one. The checkpoint is the one checkpoint.save writes, between the same two ends
(checkpoint.begin, checkpoint.complete). One save is in flight at most.
"""

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import checkpoint
from parallel import all_reduce_sum


class AsyncSaves:
    """This run's checkpoints, written in the background: save(it, rng_states, meta) starts one
    on every rank; finish_if_written(now), called by the loop after each step it takes, finishes
    it once every rank has written; finish(now) waits for it (before a rollback, at the end)."""

    def __init__(self, out_dir, model, optimizer, mesh, keep, resumed_from=None):
        self.out_dir, self.model, self.optimizer, self.mesh = out_dir, model, optimizer, mesh
        self.keep, self.resumed_from = keep, resumed_from
        # the background write runs DCP's collectives while the loop runs its own: two threads
        # must not share a process group, and DCP's async save needs a CPU backend (gloo), even
        # on nccl. Every rank makes it, once, before the first save.
        self.group = dist.new_group(backend="gloo") if mesh.backend else None
        # the save in flight: (its directory, its write, rng_states, meta)
        self.pending = None

    def save(self, it, rng_states, meta):
        """Like checkpoint.save, but returns once the state is copied to CPU memory.
        rng_states and meta belong to iteration `it`, whenever the save finishes."""
        self.finish(it)  # the previous save first
        tmp = checkpoint.begin(self.out_dir, it, self.model, self.mesh)
        state = checkpoint.train_state(self.model, self.optimizer)
        self.pending = (tmp, self._write(state, tmp), rng_states, meta)

    def _write(self, state, tmp):
        """A Future of this rank's file hashes: DCP copies the state to CPU memory now and writes
        it in the background; a thread of its own waits for that write and hashes the files."""
        writer = checkpoint.FileSystemWriter(tmp)
        try:
            written = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                     no_dist=not self.mesh.backend)
        # staging failed (out of CPU memory): reported at the finish. (DCP's exception derives
        # from BaseException)
        except (Exception, CheckpointException) as e:
            failed = Future()
            failed.set_exception(e)
            return failed

        def write_then_hash():
            written.result()
            return checkpoint.own_hashes(tmp, self.mesh.rank)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt_hash")
        work = pool.submit(write_then_hash)
        pool.shutdown(wait=False)  # the thread ends when its one job is done
        return work

    def written(self):
        """True once this rank's part of the save in flight is on disk (or none is in flight)."""
        return self.pending is None or self.pending[1].done()

    def finish_if_written(self, now):
        """The save in flight becomes the latest once every rank has written its part: the ranks
        agree on it (a collective, only while one is in flight) and finish it together."""
        if self.pending is not None:
            ready = all_reduce_sum(torch.tensor(float(self.written())), self.mesh).item()
            if ready == self.mesh.world:
                self.finish(now)

    def finish(self, now):
        """Makes the save in flight the latest checkpoint. Every rank calls it at the same point
        (`now`: the iteration then); a failed write raises here, on every rank."""
        if self.pending is None:
            return
        (tmp, work, rng_states, meta), self.pending = self.pending, None
        hashes, error = {}, None
        try:
            hashes = work.result()
        except (Exception, CheckpointException) as e:
            error = checkpoint.cause(e)
        path = checkpoint.complete(tmp, hashes, error, rng_states, meta, self.mesh, self.keep,
                                   self.resumed_from)
        self.mesh.print0(f"saved checkpoint {path} (async: finished at iteration {now})")
