"""torch.distributed's side: backend ``"aiocoll"`` (``_backend``), gloo's ``monitored_barrier``
(``_monitored``), and what a world made dying with it (``_belongings``).
"""
