"""``python -m freetoken_core.engine.tp_rank``: one tensor-parallel rank other than 0, as an
mp child process (``tensor_parallel.main``; a module of its own so that ``-m`` does not run
a module the package has already imported)."""

from freetoken_core.engine.tensor_parallel import main

if __name__ == "__main__":
    main()
