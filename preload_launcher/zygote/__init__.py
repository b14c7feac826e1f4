"""The zygote: one preloaded, CUDA-clean interpreter that serves a socket and forks each
step. Its life and loop (``server``, ``requests``, ``running``), its preload (``preload``,
``entries``, ``culprits``, ``scouts``, ``deferral``, ``guards``, ``crashes``, ``verdicts``), what
it reads and holds for steps (``envreads``, ``threads``, ``staleness``), what it learns
(``learn``, ``profiles``) and the children it forks ahead (``prewarm``)."""
