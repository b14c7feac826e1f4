import bound_pkg.sub  # noqa: F401  (the import system binds bound_pkg.sub to the module)
