from libs.engine.checkpoints.generate import main

main()
