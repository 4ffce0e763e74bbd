from libs.model.checkpoints.generate import main

main()
