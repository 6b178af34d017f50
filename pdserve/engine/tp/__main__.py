"""`python -m pdserve.engine.tp`: one rank of a tensor-parallel engine, started by rank 0."""

from pdserve.engine.tp.rank import main

if __name__ == "__main__":
    main()
