from libs.cli.main import main

main()
