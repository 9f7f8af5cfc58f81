from qeval.cli import main

main()
