"""The process group and its lifecycle: launching the ranks (``launch``), joining and leaving the
group (``process_group``), each process's logs and name (``logs``), rank 0 stepping the group
(``control``), the step watchdog (``watchdog``), a rank's memory (``memory``), and rank 0's watch
while it serves: load progress, the other step groups, failure, drain (``lifecycle``).

Knows nothing of HTTP or of the APIs; the engine's plans and results cross it as
``server.engine.plan_wire`` records."""
