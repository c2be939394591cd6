"""Real process groups (gloo, NCCL) under the async ``Comm``: issuing in order, completions into
the loop, object transport, checks and deadlocks across processes, hybrid worlds.
"""
