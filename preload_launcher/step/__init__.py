"""A forked step: the one fork and the one exit path (``runtime``), becoming the step
(``become``), and a python program run as a fresh interpreter runs it: start-up settings,
streams, ``__main__``, the module table handed back at import, and the program's own end."""
