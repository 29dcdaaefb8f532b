"""prefect.yaml's entrypoint and `python -m pipelines.tune` from the project folder: the flow is
`xbn.flows.tune`."""

from xbn.flows.tune import main, tune_flow  # noqa: F401

if __name__ == "__main__":
    main()
