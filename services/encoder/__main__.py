from services.encoder.service import main

main()
