"""A test double (not an engine): a worker's view of its own process, for tests/engines/test_zygote.py.
Imported, it does what a vLLM worker does before its first vLLM import, then imports what a zygote
preloads; its `version()` answers with the worker's environment, its signal dispositions, what
vLLM read from it, and the vector ISAs torch's inductor finds here (where vLLM is: whether the
worker inherited them)."""

import json
import os
import signal
import sys

from harness.engines.base import Engine
from harness.engines.zygote import preloaded_modules

VLLM_BEFORE = "vllm" in sys.modules
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as harness.engines.vllm.engine does
for module in preloaded_modules():
    __import__(module)


class EnvironmentProbe(Engine):
    def version(self):
        vllm = sys.modules.get("vllm.envs")
        wakeup = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(wakeup)
        answer = {
            "environ": dict(os.environ),
            "signals": {"SIGCHLD": str(signal.getsignal(signal.SIGCHLD)), "wakeup_fd": wakeup},
            "vllm_preloaded": VLLM_BEFORE,
            "vllm_multiprocessing": None if vllm is None else bool(vllm.VLLM_ENABLE_V1_MULTIPROCESSING),
        }
        if vllm is not None:
            from torch._inductor.cpu_vec_isa import valid_vec_isa_list

            answer["isas_inherited"] = valid_vec_isa_list.cache_info().currsize > 0
            answer["isas"] = [str(isa) for isa in valid_vec_isa_list()]
        return json.dumps(answer)
