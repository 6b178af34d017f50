"""`python -m pdserve.engine.pp`: one stage of a pipeline-parallel engine, started by stage 0."""

from pdserve.engine.pp.stage import main

if __name__ == "__main__":
    main()
