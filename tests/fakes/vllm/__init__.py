"""The fake vLLM engine cores, now `zmqdp.vllm.mock` (shipped for `zmqdp mock --wire
vllm`); re-exported here under their old names for the tests and benchmarks. (A package
rather than tests/fakes/vllm.py: git then sees that file renamed to zmqdp/vllm/mock.py,
and a merge carries edits made to it there.)"""

from zmqdp.vllm.mock import *  # noqa: F403
from zmqdp.vllm.mock import (  # noqa: F401  (names outside __all__ the tests use)
    ABORT,
    DP_INIT_KEYS,
    DP_PORT_RETRIES,
    ENGINE_CORE_DEAD,
    ERROR,
    KV_FETCH_STAGES,
    LENGTH,
    QUEUED,
    SCHEDULED,
    STOP,
    VERSIONS,
    _init_problem,
    dec,
    enc,
    output_entry,
    outputs_message,
    play,
    prefix_cache_stats,
    request_error,
    scheduler_stats,
)
