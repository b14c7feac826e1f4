"""The front doors' parts: the CLI's verbs (``cli_*``), the warm daemon, the
``PRELOAD_LAUNCHER=suite`` switch (``suite_wide``) and the text printed about a preload. The
doors themselves keep their public names at the top: ``preload_launcher.cli`` (the console
script, ``python -m preload_launcher.cli``) and ``preload_launcher.pytest_plugin``."""
