"""The ideal mode's worker: one plain vLLM gRPC server (prefix caching on, no KV connector, not registered).

It is started with the same command builder as the P/D workers (``kvshuttle.workers.vllm_process``, role ``colocated``), on
the first prefill worker's CPUs by default, so its prefill runs on the same share of the machine as P's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from kvshuttle.services.devtools.etcd_process import free_port
from kvshuttle.services.devtools.stack import cpu_binds
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.workers.vllm_process import COLOCATED, VllmProcess, WorkerConfig

log = logging.getLogger("kvshuttle.bench")


class IdealWorker:
    def __init__(self, cfg, work: Path):
        workers = cfg.prefill_workers + cfg.decode_workers
        gpus = cfg.gpu_list
        if gpus and len(gpus) <= workers:
            raise ValueError("--gpus: the ideal worker needs its own GPU after the P and D workers' ones")
        cpus = "" if gpus else cfg.ideal_cpus or cpu_binds(workers)[0]
        self.cfg = WorkerConfig(
            role=COLOCATED, model=str(Path(cfg.model_dir).resolve()), grpc_port=free_port(), nixl_port=free_port(),
            cpu_bind=cpus, cpu_affinity=cpus, cuda_visible_devices=gpus[workers] if gpus else "", dtype=cfg.dtype,
            max_model_len=cfg.max_model_len, work_dir=str(work), nice=cfg.worker_nice, worker_id="ideal",
            vllm_idle_spin_ms=cfg.vllm_idle_spin_ms)
        self.process = VllmProcess(self.cfg)
        self.address = self.cfg.local_grpc_address

    async def start(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        await self.process.start()
        engine = EngineClient(self.address, timeout_s=timeout_s)
        try:
            while not await engine.is_serving(timeout_s=2.0):
                if self.process.returncode is not None:
                    raise RuntimeError(f"the ideal worker's vLLM exited ({self.process.returncode}):\n"
                                       f"{self.process.log_tail(30)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the ideal worker was not serving in time:\n{self.process.log_tail(30)}")
                await asyncio.sleep(0.5)
            if self.cfg.cpu_affinity:
                from kvshuttle.workers.affinity import parse_cpus, pin_tree

                await asyncio.to_thread(pin_tree, self.process.pid, parse_cpus(self.cfg.cpu_affinity))
            async for _ in engine.generate("ideal-warm-up", list(range(10, 26)), max_tokens=2, stream=False):
                pass
            log.info("ideal worker serving on %s (CPUs %s)", self.address, self.cfg.cpu_affinity)
        finally:
            await engine.close()

    async def stop(self) -> None:
        await self.process.stop()
