import os, signal, sys, threading, atexit
how = sys.argv[1]
print("start", flush=False)
print("to-stderr", file=sys.stderr)
if how == "atexit":
    atexit.register(lambda: print("atexit ran"))
elif how == "thread":
    main_done = threading.Event()  # not a sleep: the main thread may be slow under load

    def work():
        main_done.wait()
        print("thread finished")
    threading.Thread(target=work).start()
elif how == "code3":
    sys.exit(3)
elif how == "message":
    sys.exit("fatal: bad things")
elif how == "raise":
    raise ValueError("boom")
elif how == "signal":
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGTERM)
elif how == "segv":
    sys.stdout.flush()
    import ctypes
    ctypes.string_at(0)
elif how == "keyboard":
    raise KeyboardInterrupt
elif how == "gc-callback":  # python's collections at exit call no gc callback (its globals are
    import gc, time         # cleared by then)
    gc.callbacks.append(lambda phase, info: time.perf_counter())
    cycle = []
    cycle.append(cycle)
elif how.startswith("hook-"):  # an uncaught exception meets a broken or missing excepthook
    atexit.register(lambda: print("atexit ran"))

    def broken_hook(*exc_info):
        raise ValueError("the hook broke")

    def exiting_hook(*exc_info):
        raise SystemExit(7)
    if how == "hook-missing":
        del sys.excepthook
    else:
        sys.excepthook = {"hook-raises": broken_hook, "hook-none": None,
                          "hook-exits": exiting_hook}[how]
    raise KeyError("the original")
print("end")
if how == "thread":
    main_done.set()  # the thread finishes after the main thread's end: python waits for it
