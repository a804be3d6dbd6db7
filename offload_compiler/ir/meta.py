"""The ``node.meta`` / ``GraphModule.meta`` keys trinity's passes write and read.

Each pass's docstring says which of these it reads and writes.

* :data:`NOTE_KEY` (``node.meta["trinity"]``, ``str``): a human-readable note on an inserted or
  changed node, shown as a comment in the dumps (``offload_compiler/dump.py``).
* :data:`STREAM_KEY` (``node.meta["trinity_stream"]``, ``int``): the compute stream a node runs on
  (``passes/assign_streams.py``; 0, the stream current when the graph started, where absent).
* :data:`RECOMPUTE_KEY` (``node.meta["trinity_recompute"]``): marks a node that
  ``passes/insert_recompute.py`` inserted into the backward to recompute a saved value.
* :data:`PARAM_COPY_KEY` (``node.meta["trinity_param_copy"]``, ``(direction, bytes)``, direction
  ``"h2d"`` or ``"d2h"``): a parameter op that copies (``passes/param_residency.py``), read by
  the timeline simulator and the dumps.
* :data:`PREPARED_KEY` (``GraphModule.meta["trinity_prepared"]``, ``bool``, on the forward): the
  pair was prepared for planning (``pipeline.prepare``).
* :data:`TARGET_DEVICE_KEY` (``GraphModule.meta["trinity_target_device"]``, ``str``, a device
  type such as ``"cuda"``): the device the graphs will be compiled for when it differs from their
  fake values' (``plan`` traces on the CPU for a GPU's figures; ``plan_cli.plan_step`` writes it).
  Liveness's model of Inductor's fusions reads it (``passes/liveness.py``).
"""

from __future__ import annotations

__all__ = ["NOTE_KEY", "STREAM_KEY", "RECOMPUTE_KEY", "PARAM_COPY_KEY", "PREPARED_KEY", "TARGET_DEVICE_KEY"]

NOTE_KEY = "trinity"
STREAM_KEY = "trinity_stream"
RECOMPUTE_KEY = "trinity_recompute"
PARAM_COPY_KEY = "trinity_param_copy"
PREPARED_KEY = "trinity_prepared"
TARGET_DEVICE_KEY = "trinity_target_device"
