"""prefect.yaml's entrypoint and `python -m pipelines.retrain` from the project folder: the flow is
`xbn.flows.retrain`."""

from xbn.flows.retrain import main, retrain  # noqa: F401

if __name__ == "__main__":
    main()
