from services.colocated.service import main

main()
