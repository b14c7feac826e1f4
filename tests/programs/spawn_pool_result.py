"""A spawn pool whose workers return instances of a class this script defines: the results
are unpickled in this process through __mp_main__, which multiprocessing's import makes this
__main__."""
import multiprocessing
import sys


class Result:
    def __init__(self, x):
        self.x = x

    def __repr__(self):
        return f"Result({self.x})"


def work(x):
    return Result(x * 2)


if __name__ == "__main__":
    print(sys.modules["__mp_main__"] is sys.modules["__main__"], flush=True)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print(pool.map(work, [1, 2]), flush=True)
