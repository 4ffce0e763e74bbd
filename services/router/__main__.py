from services.router.service import main

main()
