"""The launchers a step can be, served in the forked step: ``torchrun`` (an agent, its
ranks, the rendezvous, torch elastic's own handling) and ``accelerate launch`` (its own parser
and launcher functions, the ``Popen`` they use forking instead of exec'ing)."""
