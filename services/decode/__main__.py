from services.decode.service import main

main()
