"""The caller's side: what runs in the process that asks for a step (``run()``, the CLI, a
test): choose or start a zygote, check the call's arguments as ``subprocess`` does, send the
step and wait for its output and exit code. It never imports what runs forked (``zygote``,
``step``, ``launchers``): ``import preload_launcher`` stays light."""
