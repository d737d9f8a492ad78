"""`python -m prism_megatron` is the same as the `prism-megatron` command."""

from prism_megatron.cli import main

if __name__ == "__main__":
    main()
