"""What a rank's thread has of a process: its environment, pid, exit, logging, libraries' states and generators.

Each rank of a sync world is a thread that must behave as if it were its own process. The
modules here keep what a process has of its own, per rank: ``_procstate`` (its environment,
argv, pid, exit and atexit), ``_logstate`` (``logging``), ``_libstate`` (accelerate's and
Lightning's rank), ``_locals`` (its own random generators and thread-locals). Below the engine:
they know ranks only through ``aiocoll._current``.
"""
