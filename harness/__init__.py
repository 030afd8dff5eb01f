"""What tests and benchmarks share, outside the installed package: launching torchrun, the
launcher or several agents and collecting each rank's result (launch.py), and the Hugging Face
scripts they run (hf_script.py, sft_script.py)."""
