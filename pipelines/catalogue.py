"""prefect.yaml's entrypoint and `python -m pipelines.catalogue` from the project folder: the flow is
`xbn.flows.catalogue`."""

from xbn.flows.catalogue import catalogue, main  # noqa: F401

if __name__ == "__main__":
    main()
