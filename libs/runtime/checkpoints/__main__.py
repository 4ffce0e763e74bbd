from libs.runtime.checkpoints.generate import main

main()
