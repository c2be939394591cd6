"""The engine: one rendezvous per (group, sequence number), the last arrival runs the op.

``_world`` (``World``: the groups, ranks, loop, lock; it enters works and aborts) and the
collaborators it owns, one job each: ``_groups`` + ``_grouptimeouts`` (a group's rendezvous and
its timeout), ``_runner`` (where and in what order ops run), ``_p2p`` (send/recv matching),
``_deadlines``, ``_liveness`` (deadlocks), ``_tasks`` + ``_turns`` (which tasks and threads act
for a rank), ``_record`` + ``_faults`` + ``_inject`` (the probes: recorders and fault
injection), ``_engine_comm`` (the ``Comm`` of a rank of ``spawn``). It knows nothing of what an
op does (``aiocoll._ops``) and nothing of real process groups (``aiocoll._bridge``).
"""
