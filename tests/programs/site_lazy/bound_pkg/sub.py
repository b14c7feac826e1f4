NAME = "the submodule"
