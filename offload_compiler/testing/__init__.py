"""Test tools shipped with trinity, not part of the product runtime: the interleaving executor
(:mod:`.interleave`) that the ``fault_injection`` option uses for multi-stream graphs."""
