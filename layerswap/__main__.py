"""``python -m layerswap``: the same command line as the ``layerswap`` script."""

from layerswap.cli import main

if __name__ == "__main__":
    main()
