"""trinity: a ``torch.compile`` backend that trains models bigger than the GPU.

Use it through ``torch.compile(model, backend="trinity", options={...})``; the backend name is
registered by the ``torch_dynamo_backends`` entry point, so nothing needs importing. Importing
this package gives the reports and the tools::

    import offload_compiler
    offload_compiler.last_report()          # what the planner did to the last compiled graph pair
    offload_compiler.reports()              # all of them
    offload_compiler.measure_peak_device_bytes(step)   # peak device bytes, with or without a GPU
    offload_compiler.CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=...)  # offload="all"
    with offload_compiler.materialized(model.parameters()): ...  # real parameters between steps
    offload_compiler.step_report(model)     # the training step's budget, predicted peak, pairs
"""

from .options import MemoryBudget, TrinityOptions, format_bytes, parse_size
from .report import TrinityReport, last_report, reports
from .runtime import grad_sync as _grad_sync_kernels  # noqa: F401  (registers the trinity::grad_sync ops' kernels)
from .runtime import ops as _kernels  # noqa: F401  (registers the trinity::* transfer and stream kernels)
from .runtime import param_ops as _param_kernels  # noqa: F401  (registers the trinity::param_* kernels)
from .runtime.accounting import MemoryMeasurement, measure_peak_device_bytes
from .runtime.cpu_optim import CPUOptimizer
from .runtime.model_state import install_state_dict_hooks, materialized
from .step_budget import StepReport, step_report

__version__ = "0.1.0"

__all__ = [
    "CPUOptimizer",
    "install_state_dict_hooks",
    "materialized",
    "MemoryBudget",
    "MemoryMeasurement",
    "TrinityOptions",
    "TrinityReport",
    "format_bytes",
    "last_report",
    "measure_peak_device_bytes",
    "parse_size",
    "reports",
    "StepReport",
    "step_report",
    "__version__",
]


def __getattr__(name: str):
    # The backend function is importable as offload_compiler.trinity without importing Inductor
    # at package import time.
    if name == "trinity":
        from .backend import trinity

        return trinity
    raise AttributeError(name)
