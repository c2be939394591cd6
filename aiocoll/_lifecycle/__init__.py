"""A world's run: its keywords (``_config``), its lifecycle (``_driver``), its failures and report
(``_outcome``), a world on a loop of its own (``_worldthread``), and the world that stands for
processes (``_procworld``).
"""
