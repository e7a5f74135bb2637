from rollingkv_cli.cli import main

main()
