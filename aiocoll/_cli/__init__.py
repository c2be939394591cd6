"""``aiocoll run``: torchrun's command line (``_run``), each rank's ``__main__`` and output,
``mp.spawn`` and ``multiprocessing.Process`` as ranks, and the processes mode with its checked
groups.
"""
