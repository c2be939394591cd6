"""torch's test harnesses as aiocoll worlds: the shared settings and runs (``_harness``) and the
worlds that stay up across tests (``_continuous``); ``aiocoll.testing`` is their face.
"""
