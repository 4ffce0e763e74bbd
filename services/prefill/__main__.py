from services.prefill.service import main

main()
